"""Races of recipes to a target Dice, as a library: data -> optional tuning -> run to target -> doctor -> results files.

The ``monai-fast demo``, ``bench`` and ``tune`` commands and ``benchmarks/time_to_dice.py`` are
thin callers of these functions. Options are plain typed fields of `RaceSpec`, all
checked before anything trains (`OptionError` names the bad one).

Examples:
    >>> from monai_fast.apps.demo import RaceSpec, SyntheticData, race
    >>> spec = RaceSpec(recipes=("fast", "baseline"), target=0.8, time_budget_s=120, device="cpu",
    ...                 synthetic=SyntheticData(cases=8, shape=(64, 64, 32)), run_dir="runs/mine")
    >>> run = race(spec)  # doctest: +SKIP
    >>> for r in run.results:  # doctest: +SKIP
    ...     print(r.recipe, r.reached, r.time_to_target_s, r.diagnosis["verdict"])
"""

from monai_fast.apps.demo.bench import REFERENCES, BenchRun, bench, summarize
from monai_fast.apps.demo.core import RaceEvents, RaceRun, TuneRun, checked_data, load_data, race, run_meta, tune_only
from monai_fast.apps.demo.options import (
    OptionError,
    RacePlan,
    RaceSpec,
    SyntheticData,
    TuneOptions,
    plan_race,
)

__all__ = [
    "REFERENCES",
    "BenchRun",
    "RaceEvents",
    "OptionError",
    "RacePlan",
    "RaceRun",
    "RaceSpec",
    "SyntheticData",
    "TuneOptions",
    "TuneRun",
    "bench",
    "checked_data",
    "load_data",
    "plan_race",
    "race",
    "run_meta",
    "summarize",
    "tune_only",
]
