"""The race: data -> optional tuning -> each recipe to the target -> doctor -> results files, and their report."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from monai_fast.apps.demo.headline import headline
from monai_fast.apps.demo.interleave import run_interleaved
from monai_fast.apps.demo.options import OptionError, RacePlan, RaceSpec, TuneOptions, plan_race
from monai_fast.apps.training.data import DataSource, check_files, load_files
from monai_fast.apps.training.options import check_writable_dir, recipe_config
from monai_fast.apps.training.results import run_meta, write_results
from monai_fast.apps.training.run import TrainResult, run_to_target
from monai_fast.files import write_json

__all__ = [
    "RaceEvents",
    "RaceRun",
    "TuneRun",
    "best_dice_by",
    "checked_data",
    "format_table",
    "load_data",
    "race",
    "run_meta",
    "speedup",
    "tune_only",
    "write_race",
]

logger = logging.getLogger(__name__)

#: under a total bound, the share of it kept after training for the doctor and the results files
REPORT_SHARE = 0.15
#: and the seconds kept at the least (the reports cost about the same whatever the bound)
REPORT_MIN_S = 10.0


def report_reserve_s(total_budget_s: float) -> float:
    """Seconds of a total bound kept for the reports: `REPORT_SHARE` of it, at least `REPORT_MIN_S`, at most half."""
    return min(0.5 * total_budget_s, max(REPORT_MIN_S, REPORT_SHARE * total_budget_s))


class RaceEvents:
    """What a race tells its caller as it goes; every hook does nothing here: subclass to show progress."""

    def repeat_started(self, index: int, repeats: int) -> None:
        """A benchmark's repeat ``index`` (from 1) of ``repeats`` begins."""

    def tuned(self, tuning: Any) -> None:
        """``fast`` was tuned (a `monai_fast.tune.TuneResult`)."""

    def recipe_started(self, recipe: str, target: float, time_budget_s: float | None) -> None:
        """``recipe`` starts training to ``target``."""

    def budget_set(self, recipe: str, time_budget_s: float, how: dict) -> None:
        """``recipe``'s budget was set from the lead's time (``how``: cap, multiple, lead, lead's seconds)."""

    def time_shared(self, recipe: str, time_budget_s: float, left_s: float) -> None:
        """Under a total bound, the lead ``recipe`` may run ``time_budget_s`` (``left_s`` left after set-up)."""

    def recipe_finished(self, result: TrainResult) -> None:
        """``recipe`` stopped (target, budget or epochs); ``result.diagnosis`` is filled when it trained."""

    def race_finished(self, run: RaceRun) -> None:
        """All recipes ran and the results files are written."""


@dataclass
class RaceRun:
    """What `race()` returns: one `TrainResult` per recipe and where the results went."""

    results: list[TrainResult]
    meta: dict
    run_dir: Path
    data_root: Path | None
    device: str
    tuning: Any = None  # monai_fast.tune.TuneResult when fast was tuned

    @property
    def results_json(self) -> Path:
        return self.run_dir / "results.json"

    @property
    def epochs_csv(self) -> Path:
        return self.run_dir / "epochs.csv"

    @property
    def plot(self) -> Path:
        return self.run_dir / "dice_vs_time.png"


@dataclass
class TuneRun:
    """What `tune_only()` returns."""

    result: Any  # monai_fast.tune.TuneResult
    meta: dict
    path: Path | None


def load_data(spec: RaceSpec) -> tuple[Path | str | None, list[dict], list[dict]]:
    """``(data_root, train_files, val_files)`` of ``spec`` (`load_files()`, with its errors)."""
    source = DataSource(spec.data_dir, spec.synthetic, spec.val_fraction, spec.seed, spec.train_files, spec.val_files)
    return load_files(source, spec.progress)


def checked_data(spec: RaceSpec) -> tuple[Path | str | None, list[dict], list[dict]]:
    """`load_data()`, then `check_files()` with ``spec.preflight``; `PreflightError` names every bad file."""
    data_root, train_files, val_files = load_data(spec)
    check_files(train_files, val_files, recipe_config(spec.overrides, spec.seed), spec.preflight)
    return data_root, train_files, val_files


def _tune(plan: RacePlan, train_files: Sequence[dict], val_files: Sequence[dict]):
    from monai_fast.apps.recipes.tuning import tune_recipe, typical_val_shape
    from monai_fast.tune import TuningError

    opts: TuneOptions = plan.spec.tune or TuneOptions()
    try:
        return tune_recipe(
            plan.config,
            typical_val_shape(val_files, plan.config),
            plan.device,
            space=plan.space,
            memory_cap_mib=opts.memory_cap_mib,
            store=opts.store,
            force=opts.retune,
            progress=plan.spec.progress,
            train_files=train_files if opts.place_cache else None,
            cache_tradeoff=opts.cache_tradeoff,
        )
    except ValueError as e:
        raise TuningError(str(e)) from e


def _finished(result: TrainResult, events: RaceEvents) -> TrainResult:
    from monai_fast.report.doctor import doctor

    if result.run_dir is not None and result.epochs:
        try:
            result.diagnosis = doctor(result.run_dir).to_dict()
        except (FileNotFoundError, ValueError) as e:  # a race's results outlive a record the doctor cannot read
            logger.warning("%s: no diagnosis: %s", result.recipe, e)
    events.recipe_finished(result)
    return result


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


def race(spec: RaceSpec, events: RaceEvents | None = None) -> RaceRun:
    """Race ``spec.recipes`` to ``spec.target`` on the same data; diagnose each run; write the results files.

    Every option is checked first (`plan_race()`); each recipe trains into ``run_dir/<recipe>/``.

    Args:
        spec: the race's options.
        events: hooks told of each step (printing is the caller's).

    Raises:
        OptionError: a bad option, named, before anything runs.
        monai_fast.tune.TuningError: tuning found nothing that fits.

    Example:
        >>> run = race(RaceSpec(recipes=("fast", "baseline"), target=0.8, device="cpu"))  # doctest: +SKIP
    """
    started = time.monotonic()
    bound = spec.total_budget_s
    deadline = None if bound is None else started + bound - report_reserve_s(bound)
    events = events or RaceEvents()
    plan = plan_race(spec)
    data_root, train_files, val_files = checked_data(spec)
    cases = (len(train_files), len(val_files), data_root or "the given file lists", plan.device)
    logger.info("%d training / %d validation cases from %s on %s", *cases)
    configs = dict.fromkeys(spec.recipes, plan.config)
    tuning = None
    if spec.tune is not None and "fast" in spec.recipes:
        tuning = _tune(plan, train_files, val_files)
        configs["fast"] = tuning.apply(plan.config)
        events.tuned(tuning)
    meta = run_meta(data_root, plan.device, spec.record_options)
    set_up = time.monotonic()
    if spec.interleave:
        results, paired, budget, host = run_interleaved(
            spec.recipes,
            configs,
            train_files,
            val_files,
            plan.device,
            spec.target,
            spec.time_budget_s,
            spec.budget_multiple,
            plan.run_dir,
            spec.progress,
            events,
            epoch_multiple=spec.epoch_multiple,
            deadline=deadline,
        )
        trained = time.monotonic()
        meta["headline"] = headline(results, paired, budget, host=host)
        for r in results:
            _finished(r, events)
    else:
        run_options = {"time_budget_s": spec.time_budget_s, "run_dir": plan.run_dir, "progress": spec.progress}
        results = []
        for name in spec.recipes:
            events.recipe_started(name, spec.target, spec.time_budget_s)
            result = run_to_target(name, train_files, val_files, configs[name], plan.device, spec.target, **run_options)
            results.append(_finished(result, events))
        trained = time.monotonic()
    if tuning is not None:
        meta["tuning"] = {**tuning.to_dict(), "from_cache": tuning.from_cache}
    if bound is not None:  # where a bounded race's time went, for whoever checks the bound
        meta["clock"] = {
            "total_budget_s": bound,
            "reports_reserved_s": report_reserve_s(bound),
            "set_up_s": set_up - started,
            "training_s": trained - set_up,
            "headline_and_doctor_s": time.monotonic() - trained,
        }
    write_race(results, plan.run_dir, meta)
    run = RaceRun(results, meta, plan.run_dir, data_root, plan.device, tuning)
    events.race_finished(run)
    return run


def tune_only(spec: RaceSpec, out: str | os.PathLike | None = None) -> TuneRun:
    """Tune the ``fast`` recipe on ``spec``'s data and device (``spec.tune``, default `TuneOptions`).

    Args:
        spec: the data, device, recipe options and tuning options (recipes, target and run folder unused).
        out: also write the result with every trial (and the machine, versions, options) to this JSON file.
    """
    spec = replace(spec, recipes=("fast",), tune=spec.tune or TuneOptions())
    plan = plan_race(spec, need_run_dir=False)
    if out is not None:
        check_writable_dir(Path(out).parent, "out")
        if Path(out).is_dir():
            raise OptionError("out", f"{out} is a folder; name a JSON file")
    data_root, train_files, val_files = checked_data(spec)
    result = _tune(plan, train_files, val_files)
    meta = run_meta(data_root, plan.device, spec.record_options)
    if out is not None:
        write_json({**meta, "tuning": result.to_dict()}, Path(out))
    return TuneRun(result=result, meta=meta, path=None if out is None else Path(out))
