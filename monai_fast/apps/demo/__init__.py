"""Races of recipes to a target Dice, as a library: data -> optional tuning -> run to target -> doctor -> results files.

The ``monai-fast demo``, ``bench`` and ``tune`` commands and ``benchmarks/time_to_dice.py`` call
these functions; every option of a `RaceSpec` is checked before anything trains (docs/demo.md).
"""

from monai_fast.apps.demo.bench import REFERENCES, BenchRun, bench, summarize
from monai_fast.apps.demo.core import RaceEvents, RaceRun, TuneRun, checked_data, load_data, race, run_meta, tune_only
from monai_fast.apps.demo.options import OptionError, RacePlan, RaceSpec, SyntheticData, TuneOptions, plan_race

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
