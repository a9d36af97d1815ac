"""Naming a data item: its index and files, and the one error type that carries them.

Example:
    >>> item_files({"image": "/d/a.nii.gz", "label": "/d/a_seg.nii.gz", "id": 3})
    'image=/d/a.nii.gz, label=/d/a_seg.nii.gz'
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["DataItemError", "LoaderTimeoutError", "describe_item", "error_text", "item_files"]


class DataItemError(RuntimeError):
    """Producing one data item failed; the message names the item and its files.

    ``reason`` is the underlying ``Type: message`` when known (``None`` after a trip through a
    worker process, which rebuilds the error from its text), so a caller adding its own context
    (the item's index) can quote the cause without naming the files twice.

    Example:
        >>> str(DataItemError("loading image=/d/a.nii.gz failed: EOFError: truncated", reason="EOFError: truncated"))
        'loading image=/d/a.nii.gz failed: EOFError: truncated'
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


def item_files(item: Any) -> str:
    """The file names an item carries, ``"image=/a.nii.gz, label=/b.nii.gz"``; ``""`` when none.

    Paths are found as strings (an item before loading) or as a loaded image's
    ``meta["filename_or_obj"]`` (an item after ``LoadImaged``, e.g. out of a cache).

    Example:
        >>> item_files({"image": "/d/a.nii.gz", "label": "/d/a_seg.nii.gz", "id": 3})
        'image=/d/a.nii.gz, label=/d/a_seg.nii.gz'
    """
    if isinstance(item, (str, os.PathLike)):
        return str(item)
    if not isinstance(item, dict):
        return ""
    files = []
    for k, v in item.items():
        path = v if isinstance(v, (str, os.PathLike)) else getattr(v, "meta", {}).get("filename_or_obj")
        if isinstance(path, (str, os.PathLike)) and str(path):
            files.append(f"{k}={path}")
    return ", ".join(files)


def describe_item(dataset: Any, index: int) -> str:
    """``index`` and the file paths of item ``index`` of a MONAI dataset (its ``data`` list)."""
    data = getattr(dataset, "data", None)
    try:
        item = data[index] if data is not None else None
    except Exception:
        item = None
    files = item_files(item)
    return f"item {index} ({files})" if files else f"item {index}"


def error_text(e: BaseException) -> str:
    """``Type: message`` of the root cause of ``e``; MONAI wraps transform errors as
    ``RuntimeError("applying transform <...>")``, which then follows as "in ...". A
    :class:`DataItemError` with a known ``reason`` gives that reason (its files are named already)."""
    if isinstance(e, DataItemError) and e.reason:
        return e.reason
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    return f"{type(root).__name__}: {root}" + (f" in {e}" if root is not e else "")


class LoaderTimeoutError(DataItemError):
    """No batch arrived within the loader's ``timeout_s``; the message names what was being loaded."""
