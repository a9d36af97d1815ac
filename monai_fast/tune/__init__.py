"""Auto-tuning of batch size, sliding-window batch, validation device and precision by measured throughput."""

from monai_fast.tune.cache import CacheChoice, place_cache
from monai_fast.tune.recipe import (
    default_space,
    default_store_path,
    tune_recipe,
    typical_val_shape,
)
from monai_fast.tune.result import TuneResult
from monai_fast.tune.search import Trial, grow_then_bisect, pick_best, race
from monai_fast.tune.space import SearchSpace
from monai_fast.tune.store import TuneStore
from monai_fast.tune.tuner import Tuner, TuningError

__all__ = [
    "CacheChoice",
    "SearchSpace",
    "Trial",
    "TuneResult",
    "TuneStore",
    "Tuner",
    "TuningError",
    "default_space",
    "default_store_path",
    "grow_then_bisect",
    "pick_best",
    "place_cache",
    "race",
    "tune_recipe",
    "typical_val_shape",
]
