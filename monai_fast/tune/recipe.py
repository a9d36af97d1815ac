"""Deprecated alias of `monai_fast.recipes.tuning`: the same objects, and one ``DeprecationWarning`` on import.

The tuner core sits below the recipes, so this alias loads its binding by name on import rather than
by a static import.
"""

import warnings
from importlib import import_module

warnings.warn(
    "monai_fast.tune.recipe is deprecated and will be removed in the next release; import monai_fast.recipes.tuning",
    DeprecationWarning,
    stacklevel=2,
)

_new = import_module("monai_fast.recipes.tuning")
__all__ = list(_new.__all__)
globals().update({name: getattr(_new, name) for name in __all__})
