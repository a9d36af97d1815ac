"""Deprecated alias of `monai_fast.race.lab`: the same objects, and one ``DeprecationWarning`` on import.

The harness is not part of the plugin, so this alias loads it by name on import rather than by a
static import.
"""

import warnings
from importlib import import_module

warnings.warn(
    "monai_fast.recipes.lab is deprecated and will be removed in the next release; import monai_fast.race.lab",
    DeprecationWarning,
    stacklevel=2,
)

_new = import_module("monai_fast.race.lab")
__all__ = list(_new.__all__)
globals().update({name: getattr(_new, name) for name in __all__})
