"""Auto-tuning of batch size, sliding-window batch, validation device and precision by measured throughput.

The tuner itself (`Tuner`, `tune_validation()`, the search, the store) measures a
network and needs nothing above `monai_fast.telemetry`, so handlers may use it. Its
binding to the recipes (`tune_recipe()` and its helpers) is
`monai_fast.recipes.tuning`; ``import monai_fast.tune`` never pulls the recipes in.
"""

from importlib import import_module
from typing import Any

from monai_fast.deprecation import deprecated
from monai_fast.tune.cache import CacheChoice, place_cache
from monai_fast.tune.result import TuneResult
from monai_fast.tune.search import Trial, grow_then_bisect, pick_best, race
from monai_fast.tune.space import SearchSpace
from monai_fast.tune.store import TuneStore, default_store_path
from monai_fast.tune.tuner import Tuner, TuningError
from monai_fast.tune.validation import tune_validation

#: deprecated aliases of `monai_fast.recipes.tuning`, imported from there when first asked for
_RECIPE_BOUND = ("default_space", "tune_recipe", "typical_val_shape")

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
    "tune_validation",
    "typical_val_shape",
]


def __getattr__(name: str) -> Any:
    if name in _RECIPE_BOUND:
        deprecated(f"monai_fast.tune.{name}", f"monai_fast.recipes.tuning.{name}")
        value = getattr(import_module("monai_fast.recipes.tuning"), name)
        globals()[name] = value  # one warning: later look-ups find the name here
        return value
    raise AttributeError(f"module 'monai_fast.tune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_RECIPE_BOUND})
