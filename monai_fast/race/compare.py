"""Side-by-side report of recipes raced to a target Dice: table, CSV, JSON and a PNG."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from monai_fast.extras import require
from monai_fast.files import atomic_write, write_json
from monai_fast.race.runner import RaceResult, write_epochs_csv

__all__ = ["best_dice_by", "format_table", "plot_dice_vs_time", "speedup", "write_race"]

logger = logging.getLogger("monai_fast.report")


def speedup(fast: RaceResult, slow: RaceResult) -> tuple[float | None, bool]:
    """How many times sooner ``fast`` reached the target than ``slow``.

    Returns:
        ``(factor, is_lower_bound)``. When only ``fast`` reached it, ``slow`` is credited with the
        time it ran, so the factor is a lower bound. ``None`` when ``fast`` did not reach it.
    """
    if not fast.reached or not fast.time_to_target_s:
        return None, False
    if slow.reached and slow.time_to_target_s:
        return slow.time_to_target_s / fast.time_to_target_s, False
    return slow.total_s / fast.time_to_target_s, True


def best_dice_by(result: RaceResult, seconds: float) -> float | None:
    """Best validation Dice ``result`` had reached ``seconds`` after its clock started."""
    seen = [e.val_dice for e in result.epochs if e.val_dice is not None and e.elapsed_s <= seconds]
    return max(seen) if seen else None


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_table(results: Sequence[RaceResult], reference: str = "baseline") -> str:
    """A plain-text table, one row per recipe, with the speed-up over ``reference``."""
    ref = next((r for r in results if r.recipe == reference), None)
    head = [
        "recipe",
        "time to target s",
        "epochs",
        "setup s",
        "train s/ep",
        "val s/ep",
        "data wait",
        "best Dice",
        "speed-up",
    ]
    lines = []
    for r in results:
        if r.reached:
            ttt = _fmt_s(r.time_to_target_s)
        else:
            ttt = f"> {r.total_s:.0f} (not reached)"
        if ref is None or r is ref:
            sp = "1.0x (ref)" if r is ref else "-"
        else:
            factor, lower = speedup(r, ref)
            sp = "-" if factor is None else f"{'>= ' if lower else ''}{factor:.1f}x"
        lines.append(
            [
                r.recipe,
                ttt,
                str(r.epochs_to_target if r.reached else r.epochs_run),
                _fmt_s(r.setup_s),
                f"{r.train_s_per_epoch:.2f}",
                f"{r.val_s_per_epoch:.2f}",
                f"{100 * r.data_wait_share:.1f}%",
                "-" if r.best_dice is None else f"{r.best_dice:.3f}",
                sp,
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in lines]
    if ref is not None:
        for r in results:
            if r is ref or not r.reached or r.time_to_target_s is None:
                continue
            at = best_dice_by(ref, r.time_to_target_s)
            out.append(
                f"when {r.recipe} reached Dice {r.target:g} ({r.time_to_target_s:.0f} s), {ref.recipe} was at "
                + ("no validation yet" if at is None else f"Dice {at:.3f}")
            )
    return "\n".join(out)


def plot_dice_vs_time(results: Sequence[RaceResult], path: str | os.PathLike, target: float | None = None) -> Path:
    """PNG of validation Dice against wall-clock seconds (caching included), one line per recipe.

    The figure is drawn without pyplot, so the caller's matplotlib backend stays as it is.
    """
    figure = require("matplotlib.figure", extra="plots", feature="the Dice-vs-time PNG of a race")
    fig = figure.Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.subplots()
    for r in results:
        pts = [(e.elapsed_s, e.val_dice) for e in r.epochs if e.val_dice is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=3, label=r.recipe)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("wall-clock seconds since start (cache filling included)")
    ax.set_ylabel("validation mean Dice")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    ax.set_title("Time to Dice")
    fig.tight_layout()
    path = Path(path)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png")
    return path


def write_race(
    results: Sequence[RaceResult], run_dir: str | os.PathLike, meta: dict, reference: str = "baseline"
) -> dict:
    """Write ``results.json``, ``epochs.csv`` (all recipes) and ``dice_vs_time.png`` into ``run_dir``.

    Each file is tried on its own; when one cannot be written (a full disk) the others still are, each
    failure is logged with its path, and the first is raised at the end.

    Returns:
        The dict written to ``results.json``.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ref = next((r for r in results if r.recipe == reference), None)
    speedups = {}
    if ref is not None:
        for r in results:
            if r is not ref:
                factor, lower = speedup(r, ref)
                speedups[r.recipe] = {"over": reference, "factor": factor, "lower_bound": lower}
    doc = {**meta, "results": [r.to_dict() for r in results], "speedups": speedups}
    target = results[0].target if results else None
    writes = [
        (run_dir / "results.json", lambda path: write_json(doc, path)),
        (run_dir / "epochs.csv", lambda path: write_epochs_csv((e for r in results for e in r.epochs), path)),
        (run_dir / "dice_vs_time.png", lambda path: plot_dice_vs_time(results, path, target)),
    ]
    failed: list[OSError] = []
    for path, write in writes:  # each output on its own: one that does not fit costs only itself
        try:
            write(path)
        except OSError as err:
            logger.error("not written: %s: %s", path, err)
            failed.append(err)
    if failed:
        raise failed[0]
    return doc
