"""What a data set's transform chain holds, as the run record keeps it, and the advice that depends on it.

The run record lists the class names of the training chain's transforms (:func:`transform_names`), so
that advice about a transform reaches only a run whose chain it fits: precomputed crop indices
(``FgBgToIndicesd``) help a chain that crops with ``RandCropByPosNegLabeld`` and does not precompute
them yet (:func:`crop_indices_advised`). ``TimeBreakdown`` and the doctor both ask here.

Example:
    >>> from monai.transforms import Compose, LoadImaged, RandCropByPosNegLabeld
    >>> names = transform_names(Compose([LoadImaged("image"), Compose([RandCropByPosNegLabeld("image", "label", 8)])]))
    >>> names, crop_indices_advised(names), crop_indices_advised(["LoadImaged"]), crop_indices_advised(None)
    (['LoadImaged', 'RandCropByPosNegLabeld'], True, False, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from monai.transforms import Compose

__all__ = ["crop_indices_advised", "transform_names"]


def transform_names(transform: Any) -> list[str] | None:
    """The class names of a data set's transform chain, nested ``Compose`` flattened; ``None`` when there is none."""
    if transform is None:
        return None
    flat = transform.flatten() if isinstance(transform, Compose) else transform
    parts = getattr(flat, "transforms", None)
    return [type(t).__name__ for t in (parts if parts is not None else [flat])]


def crop_indices_advised(names: Sequence[str] | None) -> bool:
    """Whether precomputing crop indices (``FgBgToIndicesd``) fits a chain of ``names`` (unknown: it may)."""
    return names is None or ("RandCropByPosNegLabeld" in names and "FgBgToIndicesd" not in names)
