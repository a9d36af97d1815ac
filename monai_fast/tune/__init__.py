"""Auto-tuning of batch size, sliding-window batch, validation device and precision by measured throughput.

It needs nothing above `monai_fast.telemetry`, so handlers may use it; its binding to the recipes
(`tune_recipe()`) is `monai_fast.apps.recipes.tuning`, which ``import monai_fast.tune`` never loads.
"""

from monai_fast.tune.result import CacheChoice, TuneResult, place_cache
from monai_fast.tune.search import Trial, confirm_best, grow_then_bisect, pick_best
from monai_fast.tune.space import SearchSpace
from monai_fast.tune.store import TuneStore, default_store_path
from monai_fast.tune.tuner import Tuner, TuningError, tune_validation

__all__ = [
    "CacheChoice",
    "SearchSpace",
    "Trial",
    "TuneResult",
    "TuneStore",
    "Tuner",
    "TuningError",
    "default_store_path",
    "grow_then_bisect",
    "pick_best",
    "place_cache",
    "confirm_best",
    "tune_validation",
]
