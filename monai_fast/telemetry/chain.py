"""The class names of a data set's transform chain, as the run record keeps them, and the advice that depends on them.

``TimeBreakdown`` and the doctor ask here, so that advice about a transform reaches only a run whose chain it fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from monai.transforms import Compose

__all__ = ["crop_indices_advised", "transform_names"]


def transform_names(transform: Any) -> list[str] | None:
    """The class names of a data set's transform chain, nested ``Compose`` flattened; ``None`` when there is none.

    The chain is only read (``Compose.flatten()`` would re-seed its random transforms).
    """
    if transform is None:
        return None
    if not isinstance(transform, Compose):
        return [type(transform).__name__]
    return [name for t in transform.transforms for name in (transform_names(t) or [])]


def crop_indices_advised(names: Sequence[str] | None) -> bool:
    """Whether precomputing crop indices (``FgBgToIndicesd``) fits a chain of ``names`` (unknown: it may)."""
    return names is None or ("RandCropByPosNegLabeld" in names and "FgBgToIndicesd" not in names)
