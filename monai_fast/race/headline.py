"""The demo's headline: fast's speed-up over the baseline, each figure marked measured or estimated.

The race interleaves the recipes' epochs (the one whose clock is behind trains next), so their
seconds per epoch are measured in the same conditions: a change of the host's load hits both.
``fast``'s epochs to target and time to target are measured. The baseline's time to target is
measured when it reaches the target within its budget; otherwise it is **estimated**: its epochs to
target from its Dice curve so far (a straight line through Dice against log(epoch) over the
later half of its validations), or, when the curve does not rise, from how many more epochs it
needed than ``fast`` to reach the same Dice; times its seconds per epoch measured interleaved
with ``fast``, plus its set-up. Never a bare lower bound.

Example:
    >>> epochs_from_curve([(1, 0.1), (2, 0.2), (4, 0.3), (8, 0.4)], target=0.5)
    16.0
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from monai_fast.recipes.runner import RaceResult

__all__ = ["MEASURED", "ESTIMATED", "epochs_from_curve", "format_headline", "headline"]

MEASURED = "measured"
ESTIMATED = "estimated"


def epochs_from_curve(points: Sequence[tuple[int, float]], target: float) -> float | None:
    """Epochs to ``target`` from ``(epoch, Dice)`` points: a least-squares line of Dice against log(epoch).

    Fits the later half of the points (at least 3). ``None`` when there are fewer than 3 or the
    line does not rise.

    Example:
        >>> epochs_from_curve([(1, 0.3), (2, 0.3), (3, 0.3)], target=0.9) is None
        True
    """
    pts = [(e, d) for e, d in points if e > 0]
    if len(pts) < 3:
        return None
    pts = pts[len(pts) // 2:] if len(pts) >= 6 else pts
    xs, ys = [math.log(e) for e, _ in pts], [d for _, d in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope <= 1e-9:
        return None
    return round(math.exp(mx + (target - my) / slope), 1)


def _epochs_by_ratio(slow: RaceResult, fast: RaceResult) -> tuple[float, str] | None:
    """Epochs to target of ``slow`` scaled from ``fast``: both to ``slow``'s best Dice, ``fast`` on to the target."""
    dice = max((e.val_dice for e in slow.epochs if e.val_dice is not None), default=None)
    if dice is None or dice <= 0 or not fast.epochs_to_target:
        return None
    slow_epoch = next(e.epoch for e in slow.epochs if e.val_dice is not None and e.val_dice >= dice)  # first at its best
    fast_epoch = next((e.epoch for e in fast.epochs if e.val_dice is not None and e.val_dice >= dice), None)
    if fast_epoch is None:
        return None
    epochs = round(slow_epoch * fast.epochs_to_target / fast_epoch, 1)
    return epochs, (f"{fast.recipe} needed {fast_epoch} epoch(s) to {slow.recipe}'s best Dice {dice:.3f} "
                    f"({slow_epoch} epochs) and {fast.epochs_to_target} to the target")


def _s_per_epoch(result: RaceResult, interleaved: int) -> float:
    """Mean seconds per epoch (training + validation) over the first ``interleaved`` epochs (all when none were)."""
    rows = result.epochs[:interleaved] or result.epochs
    return statistics.fmean(r.train_s + r.val_s for r in rows) if rows else 0.0


def _figure(value: float | None, how: str, basis: str = "") -> dict:
    return {"value": value, "how": how, "basis": basis}


def headline(results: Sequence[RaceResult], interleaved: Mapping[str, int], budget: Mapping[str, object],
             fast: str = "fast", reference: str = "baseline") -> dict:
    """The headline of an interleaved race: per recipe its figures (each ``{"value", "how", "basis"}``) and the speed-up.

    Args:
        results: the race's results (``fast`` and ``reference`` among them).
        interleaved: per recipe, how many of its first epochs ran interleaved with the others.
        budget: how the budgets were set (written as is).
        fast, reference: the recipe whose speed-up is the headline, and the one it is measured against.

    Example:
        >>> headline([], {}, {})["speedup"]["how"]
        'n/a'
    """
    by = {r.recipe: r for r in results}
    doc: dict = {"method": "interleaved epochs", "budget": dict(budget), "recipes": {}}
    for r in results:
        per_epoch = _s_per_epoch(r, interleaved.get(r.recipe, 0))
        entry = {"s_per_epoch_interleaved": per_epoch, "epochs_interleaved": interleaved.get(r.recipe, 0),
                 "epochs_run": r.epochs_run, "best_dice": r.best_dice, "data_wait_share": r.data_wait_share}
        if r.reached:
            entry["time_to_target_s"] = _figure(r.time_to_target_s, MEASURED)
            entry["epochs_to_target"] = _figure(r.epochs_to_target, MEASURED)
        else:
            entry.update(_estimate(r, by.get(fast), per_epoch))
        doc["recipes"][r.recipe] = entry
    doc["speedup"] = _speedup(doc["recipes"], fast, reference)
    return doc


def _estimate(r: RaceResult, fast: RaceResult | None, per_epoch: float) -> dict:
    curve = [(e.epoch, e.val_dice) for e in r.epochs if e.val_dice is not None]
    epochs, basis = epochs_from_curve(curve, r.target), f"line through Dice vs log(epoch), {len(curve)} validations"
    if epochs is None and fast is not None and fast.reached:
        by_ratio = _epochs_by_ratio(r, fast)
        epochs, basis = by_ratio if by_ratio else (None, "")
    if epochs is None:
        why = "its Dice did not rise and fast gives no ratio; run longer (--time-budget, --budget-multiple)"
        return {"time_to_target_s": _figure(None, "n/a", why), "epochs_to_target": _figure(None, "n/a", why)}
    if epochs <= r.epochs_run:  # it ran that many without reaching the target
        epochs, basis = float(r.epochs_run + 1), f"{basis}; raised to the epochs it ran + 1"
    seconds = r.setup_s + epochs * per_epoch
    return {"epochs_to_target": _figure(epochs, ESTIMATED, basis),
            "time_to_target_s": _figure(seconds, ESTIMATED, f"set-up {r.setup_s:.1f} s + {epochs:g} epochs x "
                                        f"{per_epoch:.2f} s/epoch measured interleaved")}


def _speedup(recipes: Mapping[str, dict], fast: str, reference: str) -> dict:
    a, b = recipes.get(fast), recipes.get(reference)
    if a is None or b is None:
        return {"over": reference, "factor": None, "how": "n/a", "basis": f"needs both {fast} and {reference}"}
    ta, tb = a["time_to_target_s"], b["time_to_target_s"]
    if ta["how"] != MEASURED or not ta["value"] or tb["value"] is None:
        return {"over": reference, "factor": None, "how": "n/a", "basis": f"{fast} did not reach the target" if
                ta["how"] != MEASURED else tb["basis"]}
    how = MEASURED if tb["how"] == MEASURED else ESTIMATED
    return {"over": reference, "factor": tb["value"] / ta["value"], "how": how,
            "basis": f"{reference}'s time to target ({tb['how']}) / {fast}'s (measured)"}


def _cell(fig: dict, fmt: str) -> str:
    return "-" if fig["value"] is None else f"{fig['value']:{fmt}} ({fig['how']})"


def format_headline(doc: dict) -> str:
    """The printed table of :func:`headline`: each figure with ``(measured)`` or ``(estimated)``, then the bases.

    Example:
        >>> print(format_headline(headline([], {}, {})))
        recipe  time to target s  epochs to target  s/epoch interleaved  data wait  best Dice
        ------  ----------------  ----------------  -------------------  ---------  ---------
        speed-up: n/a (needs both fast and baseline)
    """
    head = ["recipe", "time to target s", "epochs to target", "s/epoch interleaved", "data wait", "best Dice"]
    rows = [[name, _cell(e["time_to_target_s"], ".1f"), _cell(e["epochs_to_target"], "g"),
             f"{e['s_per_epoch_interleaved']:.2f} ({MEASURED})", f"{100 * e['data_wait_share']:.1f}%",
             "-" if e["best_dice"] is None else f"{e['best_dice']:.3f}"]
            for name, e in doc["recipes"].items()]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
    out += [fmt.format(*row).rstrip() for row in rows]
    for name, e in doc["recipes"].items():
        for key in ("epochs_to_target", "time_to_target_s"):
            if e[key]["how"] != MEASURED:
                out.append(f"{name} {key.replace('_', ' ').replace(' s', '')}: {e[key]['how']}: {e[key]['basis']}")
    sp = doc["speedup"]
    if sp["factor"] is None:
        out.append(f"speed-up: n/a ({sp['basis']})")
    else:
        out.append(f"speed-up over {sp['over']}: {sp['factor']:.1f}x ({sp['how']}: {sp['basis']})")
    return "\n".join(out)
