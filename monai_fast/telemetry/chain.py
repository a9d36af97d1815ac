"""What a data set's transform chain holds, as the run record keeps it, and the advice that depends on it.

The run record lists the class names of the training chain's transforms (`transform_names()`), so
that advice about a transform reaches only a run whose chain it fits: precomputed crop indices
(``FgBgToIndicesd``) help a chain that crops with ``RandCropByPosNegLabeld`` and does not precompute
them yet (`crop_indices_advised()`). ``TimeBreakdown`` and the doctor both ask here.

Examples:
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
    """The class names of a data set's transform chain, nested ``Compose`` flattened; ``None`` when there is none.

    The chain is only read: MONAI's ``Compose.flatten()`` builds a new ``Compose``, which re-seeds every random
    transform of the chain and so would change the run's crops.
    """
    if transform is None:
        return None
    if not isinstance(transform, Compose):
        return [type(transform).__name__]
    return [name for t in transform.transforms for name in (transform_names(t) or [])]


def crop_indices_advised(names: Sequence[str] | None) -> bool:
    """Whether precomputing crop indices (``FgBgToIndicesd``) fits a chain of ``names`` (unknown: it may)."""
    return names is None or ("RandCropByPosNegLabeld" in names and "FgBgToIndicesd" not in names)
