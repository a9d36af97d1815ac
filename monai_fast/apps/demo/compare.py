"""Side-by-side report of recipes raced to a target Dice: table, CSV, JSON and a PNG."""

from __future__ import annotations

import os
from collections.abc import Sequence

from monai_fast.apps.training.results import plot_dice_vs_time, write_results
from monai_fast.apps.training.run import TrainResult

__all__ = ["best_dice_by", "format_table", "plot_dice_vs_time", "speedup", "write_race"]


def speedup(fast: TrainResult, slow: TrainResult) -> tuple[float | None, bool]:
    """How many times sooner ``fast`` reached the target than ``slow``: ``(factor, is_lower_bound)``.

    When only ``fast`` reached it, ``slow`` is credited with the time it ran, so the factor is a lower
    bound; the factor is ``None`` when ``fast`` did not reach it.
    """
    if not fast.reached or not fast.time_to_target_s:
        return None, False
    if slow.reached and slow.time_to_target_s:
        return slow.time_to_target_s / fast.time_to_target_s, False
    return slow.total_s / fast.time_to_target_s, True


def best_dice_by(result: TrainResult, seconds: float) -> float | None:
    """Best validation Dice ``result`` had reached ``seconds`` after its clock started."""
    return max((e.val_dice for e in result.epochs if e.val_dice is not None and e.elapsed_s <= seconds), default=None)


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_table(results: Sequence[TrainResult], reference: str = "baseline") -> str:
    """A plain-text table, one row per recipe, with the speed-up over ``reference``."""
    ref = next((r for r in results if r.recipe == reference), None)
    head = "recipe|time to target s|epochs|setup s|train s/ep|val s/ep|data wait|best Dice|speed-up".split("|")
    lines = []
    for r in results:
        ttt = _fmt_s(r.time_to_target_s) if r.reached else f"> {r.total_s:.0f} (not reached)"
        if ref is None or r is ref:
            sp = "1.0x (ref)" if r is ref else "-"
        else:
            factor, lower = speedup(r, ref)
            sp = "-" if factor is None else f"{'>= ' if lower else ''}{factor:.1f}x"
        start = [r.recipe, ttt, str(r.epochs_to_target if r.reached else r.epochs_run), _fmt_s(r.setup_s)]
        times = [f"{r.train_s_per_epoch:.2f}", f"{r.val_s_per_epoch:.2f}", f"{100 * r.data_wait_share:.1f}%"]
        lines.append([*start, *times, "-" if r.best_dice is None else f"{r.best_dice:.3f}", sp])
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


def write_race(
    results: Sequence[TrainResult], run_dir: str | os.PathLike, meta: dict, reference: str = "baseline"
) -> dict:
    """Write the race's results files with the speed-ups over ``reference`` (`write_results()`); returns its dict."""
    ref = next((r for r in results if r.recipe == reference), None)
    speedups = {}
    if ref is not None:
        for r in results:
            if r is not ref:
                factor, lower = speedup(r, ref)
                speedups[r.recipe] = {"over": reference, "factor": factor, "lower_bound": lower}
    return write_results(results, run_dir, meta, {"speedups": speedups})
