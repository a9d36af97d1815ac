"""Ground floor: optional dependencies, each named with the extra that installs it (docs/getting-started.md).

`require()` imports a module or raises `MissingExtraError` with the one line that installs it, before the
work starts. This module imports nothing else of monai-fast.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "available", "require"]

#: extra -> the distributions it installs (``setup.cfg`` lists the same, with versions)
EXTRAS: dict[str, tuple[str, ...]] = {
    "s3": ("s3fs",),
    "wsi": ("tifffile",),
    "onnx": ("onnx", "onnxruntime", "onnxscript"),
    "plots": ("matplotlib", "tensorboard"),
    "notebooks": ("nbclient", "nbformat", "ipykernel", "matplotlib", "tensorboard", "tifffile"),
    "nvidia": ("nvtx", "nvidia-ml-py"),
    "bundle": ("fire", "pyyaml", "tensorboard"),
}
#: a distribution's top-level module where it is not its name with ``_`` for ``-``
_MODULE_OF = {"nvidia-ml-py": "pynvml", "pyyaml": "yaml"}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""

    def __init__(self, module: str, extra: str, feature: str) -> None:
        self.module, self.extra, self.feature = module, extra, feature
        super().__init__(
            f'{feature} needs {module}, which is not installed: pip install "monai-fast[{extra}]"', name=module
        )


def available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken one
        return False


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` with MONAI's `optional_import`, or raise `MissingExtraError` naming ``extra``.

    A module installed with the extra's packages that fails to import is a broken install: MONAI's
    ``OptionalImportError`` is raised then, with the import's own traceback.

    Args:
        module: the module to import (``"s3fs"``, ``"matplotlib.pyplot"``).
        extra: the extra that installs it (a key of `EXTRAS`).
        feature: what needs it, for the message (``"reading s3://bucket/Task"``).

    Example:
        >>> plt = require("matplotlib.pyplot", extra="plots", feature="the demo's plot")
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; one of {sorted(EXTRAS)}")
    from monai.utils import optional_import  # here, not at the top: MONAI (and torch) load only when a feature asks

    found, ok = optional_import(module)
    if ok:
        return found
    if available(module) and all(available(_MODULE_OF.get(d, d.replace("-", "_"))) for d in EXTRAS[extra]):
        found()  # raises the OptionalImportError that carries the failed import's traceback
    raise MissingExtraError(module, extra, feature)
