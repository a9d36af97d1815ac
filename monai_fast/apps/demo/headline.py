"""The demo's headline: fast's speed-up over the baseline, each figure marked measured or estimated.

A baseline that misses the target has its time to target estimated from its Dice curve (docs/demo.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from monai_fast.apps.training.run import TrainResult
from monai_fast.telemetry.host import describe_host_load

__all__ = [
    "ESTIMATED",
    "MEASURED",
    "MIN_PROGRESS",
    "epochs_by_progress",
    "epochs_by_slope",
    "format_headline",
    "headline",
    "stop_reason",
]

MEASURED = "measured"
ESTIMATED = "estimated"
#: the share of the target the reference's best Dice must reach before its time to target is estimated
MIN_PROGRESS = 0.15


def epochs_by_progress(
    curve: Sequence[tuple[int, float]], fast_curve: Sequence[tuple[int, float]], fast_epochs: int, target: float
) -> tuple[float, int, float, int] | None:
    """Epochs to ``target`` for a run with Dice ``curve``, scaled from a faster run that reached it in ``fast_epochs``.

    Returns ``(epochs, slow_epoch, dice, fast_epoch)``: the estimate is ``slow_epoch * fast_epochs /
    fast_epoch``. ``None`` when the best Dice is below ``MIN_PROGRESS * target`` or the fast run never reached it.
    """
    points = [(e, d) for e, d in curve if d is not None]
    if not points:
        return None
    dice = max(d for _, d in points)
    if dice < MIN_PROGRESS * target:
        return None
    slow_epoch = next(e for e, d in points if d >= dice)  # the first epoch at its best
    fast_epoch = next((e for e, d in fast_curve if d is not None and d >= dice), None)
    if fast_epoch is None:
        return None
    return round(slow_epoch * fast_epochs / fast_epoch, 1), slow_epoch, dice, fast_epoch


def epochs_by_slope(curve: Sequence[tuple[int, float]], target: float) -> tuple[float, int, int, float] | None:
    """Epochs to ``target`` where a least-squares line through the last half of the Dice ``curve`` reaches it.

    Returns ``(epochs, first, last, slope)``; ``None`` with fewer than 4 points, a best Dice below
    ``MIN_PROGRESS * target``, or a line that does not rise.
    """
    points = [(e, d) for e, d in curve if d is not None]
    if len(points) < 4 or max(d for _, d in points) < MIN_PROGRESS * target:
        return None
    half = points[len(points) // 2 :]
    slope, intercept = statistics.linear_regression([e for e, _ in half], [d for _, d in half])
    if not slope > 0:
        return None
    return round((target - intercept) / slope, 1), half[0][0], half[-1][0], round(slope, 6)


def _epoch_seconds(result: TrainResult, interleaved: int, cpu: bool = False) -> list[float]:
    """Wall (or CPU) seconds of each whole epoch (training and validation) among the first ``interleaved``."""
    rows = result.epochs[:interleaved] or result.epochs
    if cpu:
        return [r.cpu_s for r in rows if r.cpu_s is not None]
    return [r.wall_s if r.wall_s is not None else r.train_s + r.val_s for r in rows]


def _per_unit(result: TrainResult, interleaved: int) -> dict:
    """Seconds per training crop and per validated volume (what recipes compare: their epochs hold different work)."""
    rows = result.epochs[:interleaved] or result.epochs
    crops = [r.train_samples for r in rows if r.train_samples]
    validated = [r for r in rows if r.val_volumes]
    if not validated:  # no full validation while interleaved: its epochs run alone
        validated = [r for r in result.epochs if r.val_volumes]
    volumes = sum(r.val_volumes or 0 for r in validated)
    return {
        "train_s_per_crop": sum(r.train_s for r in rows if r.train_samples) / sum(crops) if crops else None,
        "val_s_per_volume": sum(r.val_s for r in validated) / volumes if volumes else None,
        "epoch_holds": {
            "epochs": len(rows),
            "train_crops_per_epoch": statistics.median(crops) if crops else None,
            "full_validations": sum(1 for r in rows if r.val_volumes),
            "val_volumes": validated[0].val_volumes if validated else None,
        },
    }


def stop_reason(result: TrainResult, budget: Mapping[str, object]) -> str:
    """Why ``result``'s recipe stopped: ``"target"``, ``"epoch budget"``, ``"total time bound"``, ``"wall-clock
    budget"`` or ``"epoch limit"``."""
    if result.reached:
        return "target"
    epochs = budget.get("others_epochs")
    if isinstance(epochs, int) and result.epochs_run >= epochs and result.recipe != budget.get("lead"):
        return "epoch budget"
    if result.recipe in (budget.get("bound_stopped") or ()):  # type: ignore[operator]
        return "total time bound"
    if result.budget_exhausted or (result.time_budget_s is not None and result.total_s >= result.time_budget_s):
        return "wall-clock budget"
    return "epoch limit"


def _figure(value: float | None, how: str, basis: str = "") -> dict:
    return {"value": value, "how": how, "basis": basis}


def headline(
    results: Sequence[TrainResult],
    interleaved: Mapping[str, int],
    budget: Mapping[str, object],
    fast: str = "fast",
    reference: str = "baseline",
    host: Mapping[str, object] | None = None,
) -> dict:
    """The headline of an interleaved race: per recipe its figures (each ``{"value", "how", "basis"}``), the speed-up.

    Args:
        results: the race's results (``fast`` and ``reference`` among them).
        interleaved: per recipe, how many of its first epochs ran interleaved with the others.
        budget: how the budgets were set (written as is).
        fast, reference: the recipe whose speed-up is the headline, and the one it is measured against.
        host: the host's load while the epochs were taken in turns (`HostLoad.stop()`).
    """
    by = {r.recipe: r for r in results}
    doc: dict = {"method": "interleaved epochs", "budget": dict(budget), "recipes": {}}
    if host is not None:
        doc["host"] = dict(host)
    for r in results:
        n = interleaved.get(r.recipe, 0)
        seconds, cpu = _epoch_seconds(r, n), _epoch_seconds(r, n, cpu=True)
        per_epoch = statistics.fmean(seconds) if seconds else 0.0
        entry = {
            "s_per_epoch_interleaved": per_epoch,
            "epochs_interleaved": n,
            "cpu_s_per_epoch_interleaved": statistics.fmean(cpu) if cpu else None,
            "epochs_run": r.epochs_run,
            "best_dice": r.best_dice,
            "data_wait_share": r.data_wait_share,
            "stopped": stop_reason(r, budget),
            **_per_unit(r, n),
        }
        if r.reached:
            entry["time_to_target_s"] = _figure(r.time_to_target_s, MEASURED)
            entry["epochs_to_target"] = _figure(r.epochs_to_target, MEASURED)
        else:
            limit = budget.get("others_epochs") if r.recipe != budget.get("lead") else None
            entry.update(_estimate(r, by.get(fast), per_epoch, limit if isinstance(limit, int) else None, seconds))
        entry["cpu_s_to_target"] = _cpu_to_target(r, entry)
        doc["recipes"][r.recipe] = entry
    doc["speedup"] = _speedup(doc["recipes"], fast, reference)
    return doc


def _cpu_to_target(r: TrainResult, entry: dict) -> dict:
    """``r``'s CPU seconds to the target: set-up plus its epochs (measured), or per epoch x epochs (estimated)."""
    epochs = entry["epochs_to_target"]
    if r.setup_cpu_s is None or epochs["value"] is None:
        return _figure(None, "n/a", "no CPU times recorded" if r.setup_cpu_s is None else epochs["basis"])
    if epochs["how"] == MEASURED:
        rows = r.epochs[: int(epochs["value"])]
        if len(rows) < epochs["value"] or any(e.cpu_s is None for e in rows):
            return _figure(None, "n/a", "an epoch without its CPU time")
        return _figure(r.setup_cpu_s + sum(e.cpu_s for e in rows), MEASURED)
    per_epoch = entry["cpu_s_per_epoch_interleaved"]
    if per_epoch is None:
        return _figure(None, "n/a", "no CPU times recorded")
    return _figure(
        r.setup_cpu_s + epochs["value"] * per_epoch,
        ESTIMATED,
        f"set-up {r.setup_cpu_s:.1f} CPU s + {epochs['value']:g} epochs x {per_epoch:.2f} CPU s/epoch "
        "measured interleaved",
    )


def _estimate(
    r: TrainResult, fast: TrainResult | None, per_epoch: float, limit: int | None, epoch_seconds: Sequence[float] = ()
) -> dict:
    """``r``'s estimated epochs and time to target from its first ``limit`` epochs, each with its ``low``-``high``."""
    curve = [(e.epoch, e.val_dice) for e in r.epochs[:limit] if e.val_dice is not None]
    found = None
    if fast is not None and fast.reached and fast.epochs_to_target:
        found = epochs_by_progress(curve, [(e.epoch, e.val_dice) for e in fast.epochs], fast.epochs_to_target, r.target)
    sloped = epochs_by_slope(curve, r.target)
    ways = [w[0] for w in (found, sloped) if w is not None]
    if found is not None and found[0] > r.epochs_run:
        epochs, slow_epoch, dice, fast_epoch = found
        basis = (
            f"it reached Dice {dice:.3f} at epoch {slow_epoch}, {fast.recipe} at epoch {fast_epoch} and the target at "
            f"{fast.epochs_to_target}: {slow_epoch} x {fast.epochs_to_target} / {fast_epoch}"
        )
    else:  # fast's full validations do not place that Dice before its own target epoch: the curve's own slope
        if sloped is None:
            best = max((d for _, d in curve), default=0.0)
            why = (
                f"its best Dice {best:.3f} in {len(r.epochs[:limit])} epochs is below {MIN_PROGRESS:g}x the target "
                "or not rising, too early in its curve to extrapolate; give it longer (--epoch-multiple, --time-budget)"
            )
            return {"time_to_target_s": _figure(None, "n/a", why), "epochs_to_target": _figure(None, "n/a", why)}
        epochs, first, last, slope = sloped
        basis = (
            f"its Dice rose {slope:.4f} per epoch over epochs {first}-{last} (least squares over the last half of "
            f"its curve); that line reaches {r.target:g} at epoch {epochs:g}"
        )
    if epochs <= r.epochs_run:  # it ran that many without reaching the target
        epochs, basis = float(r.epochs_run + 1), f"{basis}; raised to the epochs it ran + 1"
    seconds = r.setup_s + epochs * per_epoch
    floor = float(r.epochs_run + 1)
    e_low, e_high = max(floor, min([epochs, *ways])), max(floor, epochs, *ways)
    fastest, slowest = min(epoch_seconds or [per_epoch]), max(epoch_seconds or [per_epoch])
    s_low, s_high = r.setup_s + e_low * fastest, r.setup_s + e_high * slowest
    time_basis = (
        f"set-up {r.setup_s:.1f} s + {epochs:g} epochs x {per_epoch:.2f} s/epoch measured interleaved; range "
        f"{s_low:.0f}-{s_high:.0f} s: {e_low:g}-{e_high:g} epochs x its fastest and slowest epoch "
        f"({fastest:.2f}-{slowest:.2f} s)"
    )
    return {
        "epochs_to_target": {**_figure(epochs, ESTIMATED, basis), "low": e_low, "high": e_high},
        "time_to_target_s": {**_figure(seconds, ESTIMATED, time_basis), "low": s_low, "high": s_high},
    }


def _speedup(recipes: Mapping[str, dict], fast: str, reference: str) -> dict:
    """``reference``'s time to target over ``fast``'s on the wall clock, the same ratio in CPU seconds beside it."""
    a, b = recipes.get(fast), recipes.get(reference)
    if a is None or b is None:
        out = {"over": reference, "factor": None, "how": "n/a", "basis": f"needs both {fast} and {reference}"}
        return {**out, "clock": "wall", "cpu_factor": None}
    ta, tb = a["time_to_target_s"], b["time_to_target_s"]
    if ta["how"] != MEASURED or not ta["value"] or tb["value"] is None:
        why = f"{fast} did not reach the target" if ta["how"] != MEASURED else f"{reference}'s time to target: n/a"
        out = {"over": reference, "factor": None, "how": "n/a", "basis": why, **_equal_work(a, b)}
    else:
        out = {
            "over": reference,
            "factor": tb["value"] / ta["value"],
            "how": MEASURED if tb["how"] == MEASURED else ESTIMATED,
            "basis": f"{reference}'s time to target ({tb['how']}) / {fast}'s (measured)",
        }
        if "low" in tb and "high" in tb:
            out.update(low=tb["low"] / ta["value"], high=tb["high"] / ta["value"])
    out.update(clock="wall", cpu_factor=None)
    ca, cb = a["cpu_s_to_target"], b["cpu_s_to_target"]
    if ca["how"] == MEASURED and ca["value"] and cb["value"] is not None:
        out.update(cpu_factor=cb["value"] / ca["value"], cpu_how=MEASURED if cb["how"] == MEASURED else ESTIMATED)
    return out


def _equal_work(a: Mapping[str, object], b: Mapping[str, object]) -> dict:
    """The reference's cost over the fast recipe's for equal work: ``per_crop`` and ``per_volume`` (``None``: n/a)."""

    def ratio(key: str) -> float | None:
        x, y = a.get(key), b.get(key)
        return y / x if isinstance(x, float) and isinstance(y, float) and x > 0 and y > 0 else None

    return {"per_crop": ratio("train_s_per_crop"), "per_volume": ratio("val_s_per_volume")}


def _holds(name: str, e: Mapping[str, object]) -> str | None:
    """What an epoch of recipe ``name`` held while interleaved, in words (``None`` where the rows do not say)."""
    holds = e.get("epoch_holds")
    if not isinstance(holds, dict) or holds.get("train_crops_per_epoch") is None:
        return None
    volumes = "" if holds.get("val_volumes") is None else f" of {holds['val_volumes']} volume(s)"
    return (
        f"{name} {holds['train_crops_per_epoch']:g} training crops, a full validation{volumes} after "
        f"{holds['full_validations']} of its {holds['epochs']} epochs taken in turns"
    )


_LABELS = {
    "epochs_to_target": "epochs to target",
    "time_to_target_s": "time to target",
    "cpu_s_to_target": "CPU time to target",
}


def _cell(fig: dict, fmt: str) -> str:
    return "-" if fig["value"] is None else f"{fig['value']:{fmt}} ({fig['how']})"


def format_headline(doc: dict) -> str:
    """The printed table of `headline()`: each figure with ``(measured)`` or ``(estimated)``, then the bases."""
    head = (
        "recipe|time to target s|CPU s to target|epochs to target|s/epoch interleaved|CPU s/epoch|data wait|best Dice"
    ).split("|")
    rows = [
        [
            name,
            _cell(e["time_to_target_s"], ".1f"),
            _cell(e.get("cpu_s_to_target", _figure(None, "n/a")), ".1f"),
            _cell(e["epochs_to_target"], "g"),
            f"{e['s_per_epoch_interleaved']:.2f} ({MEASURED})",
            "-" if e.get("cpu_s_per_epoch_interleaved") is None else f"{e['cpu_s_per_epoch_interleaved']:.1f}",
            f"{100 * e['data_wait_share']:.1f}%",
            "-" if e["best_dice"] is None else f"{e['best_dice']:.3f}",
        ]
        for name, e in doc["recipes"].items()
    ]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
    out += [fmt.format(*row).rstrip() for row in rows]
    for name, e in doc["recipes"].items():
        for key in ("epochs_to_target", "time_to_target_s", "cpu_s_to_target"):
            if key in e and (e[key]["how"] == ESTIMATED or (e[key]["how"] != MEASURED and key != "cpu_s_to_target")):
                out.append(f"{name} {_LABELS[key]}: {e[key]['how']}: {e[key]['basis']}")
    budget = doc["budget"]
    epochs = budget.get("others_epochs")
    for name, e in doc["recipes"].items():
        if name == budget.get("lead") or e.get("stopped") not in ("wall-clock budget", "total time bound"):
            continue
        bound = e["stopped"] == "total time bound"
        if not epochs and not bound:  # a time budget alone: the budget line says it
            continue
        what = "the total time bound" if bound else "its wall-clock budget"
        flag = "--total-budget" if bound or budget.get("total_budget_left_s") is not None else "--time-budget"
        of = f" of its {epochs}" if epochs else ""
        out.append(
            f"{name}: stopped by {what} after {e['epochs_run']}{of} epochs: how far "
            f"its Dice curve got depended on the host's speed ({flag} raises the cap)"
        )
    if doc.get("host"):
        out.append(describe_host_load(doc["host"], "the epochs taken in turns"))
    holds = [h for name, e in doc["recipes"].items() if (h := _holds(name, e)) is not None]
    if len(holds) > 1:
        out.append(
            "an epoch held: " + "; ".join(holds) + " (seconds per epoch are each recipe's own, not a comparison)"
        )
    sp = doc["speedup"]
    equal = [
        f"{what} {sp[key]:.1f}x"
        for key, what in (("per_crop", "training per crop"), ("per_volume", "validation per volume"))
        if sp.get(key)
    ]
    if sp["factor"] is None and equal:
        out.append(
            f"speed-up over {sp['over']} for equal work: {', '.join(equal)} (measured, interleaved); "
            f"to the target: n/a ({sp['basis']})"
        )
    elif sp["factor"] is None:
        out.append(f"speed-up: n/a ({sp['basis']})")
    else:
        also = "" if sp.get("cpu_factor") is None else f"; in CPU time {sp['cpu_factor']:.1f}x"
        spread = "" if sp.get("low") is None else f"; range {sp['low']:.1f}x-{sp['high']:.1f}x"
        out.append(f"speed-up over {sp['over']}: {sp['factor']:.1f}x ({sp['how']}: {sp['basis']}{spread}){also}")
    return "\n".join(out)
