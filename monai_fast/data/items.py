"""Naming a data item: its index and files, the one error type that carries them, transform chains that
name the file they fail on, and cache fills that end cleanly (docs/data.md)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from monai.transforms import Compose

__all__ = [
    "DataItemError",
    "LoaderTimeoutError",
    "NamedItemsCompose",
    "describe_item",
    "error_text",
    "fetch_item",
    "item_bytes",
    "item_files",
    "item_line",
    "named_item_errors",
    "threads_joined_on_error",
    "worker_item_error",
]


class DataItemError(RuntimeError):
    """Producing one data item failed; the message names the item and its files.

    ``reason`` is the underlying ``Type: message`` when known (``None`` after a trip through a worker
    process), so a caller adding context can quote the cause without naming the files twice.
    """

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class LoaderTimeoutError(DataItemError):
    """No batch arrived within the loader's ``timeout_s``; the message names what was being loaded."""


_WORKER_TYPE = f"{DataItemError.__name__}: "


def item_line(e: BaseException) -> str:
    """The line of a `DataItemError` that names the file, also inside a DataLoader worker's traceback text."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln.split(_WORKER_TYPE, 1)[1] for ln in lines if _WORKER_TYPE in ln]
    return named[-1] if named else (lines[0] if lines else type(e).__name__)


def item_files(item: Any) -> str:
    """The file names an item carries (strings or a loaded image's ``meta["filename_or_obj"]``), e.g.
    ``"image=/a.nii.gz, label=/b.nii.gz"``; ``""`` when none."""
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
    try:
        item = dataset.data[index]
    except Exception:
        item = None
    files = item_files(item)
    return f"item {index} ({files})" if files else f"item {index}"


def error_text(e: BaseException) -> str:
    """``Type: message`` of the root cause of ``e``, then ``in <e>`` when MONAI wrapped it.

    A `DataItemError` with a known ``reason`` gives that reason (its files are named already).
    """
    if isinstance(e, DataItemError) and e.reason:
        return e.reason
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    return f"{type(root).__name__}: {root}" + (f" in {e}" if root is not e else "")


def fetch_item(dataset: Any, index: int) -> Any:
    """``dataset[index]``, as every loader reads an item; a failure is a `DataItemError` naming it.

    Raises:
        DataItemError: ``"loading item 3 (image=/d/a.nii.gz) failed: EOFError: ..."``, the cause chained.
    """
    try:
        return dataset[index]
    except Exception as e:
        reason = error_text(e)
        raise DataItemError(f"loading {describe_item(dataset, index)} failed: {reason}", reason=reason) from e


def worker_item_error(e: BaseException) -> DataItemError | None:
    """The `DataItemError` a DataLoader worker process raised, rebuilt with its own message; else ``None``."""
    if not isinstance(e, DataItemError):
        return None
    text = str(e)
    if "DataLoader worker process" not in text or _WORKER_TYPE not in text:
        return None
    message = text.rsplit(_WORKER_TYPE, 1)[1].strip()
    _, sep, reason = message.partition(" failed: ")
    return type(e)(message, reason=reason if sep else None)


@contextmanager
def named_item_errors(item: Any) -> Iterator[None]:
    """Re-raise a failure of the block as a `DataItemError` naming ``item``'s files.

    An item without file names re-raises as it was, and a `DataItemError` passes through unchanged.
    """
    try:
        yield
    except DataItemError:
        raise
    except Exception as e:
        files = item_files(item)
        if not files:
            raise
        reason = error_text(e)
        raise DataItemError(f"transforming {files} failed: {reason}", reason=reason) from e


def item_bytes(item: Any) -> int:
    """Bytes held by the arrays and tensors in a (nested) data item."""
    if isinstance(item, torch.Tensor):
        return item.element_size() * item.nelement()
    if isinstance(item, np.ndarray):
        return int(item.nbytes)
    if isinstance(item, dict):
        return sum(item_bytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(item_bytes(v) for v in item)
    return 0


class NamedItemsCompose(Compose):
    """A ``Compose`` whose failure on an item that carries file names is a `DataItemError` naming them.

    Items without file names raise as with MONAI's ``Compose``.

    Examples:
        >>> chain = NamedItemsCompose([LoadImaged(keys="image")])
    """

    @classmethod
    def of(cls, chain: Compose, transforms: list | None = None) -> NamedItemsCompose:
        """The settings of ``chain`` over its transforms (or ``transforms``), failures named."""
        return cls(
            chain.transforms if transforms is None else transforms,
            map_items=chain.map_items,
            unpack_items=chain.unpack_items,
            lazy=chain.lazy,
            overrides=chain.overrides,
            log_stats=chain.log_stats,
        )

    def __call__(
        self, input_: Any, start: int = 0, end: int | None = None, threading: bool = False, lazy: bool | None = None
    ) -> Any:
        with named_item_errors(input_):
            return super().__call__(input_, start=start, end=end, threading=threading, lazy=lazy)


@contextmanager
def threads_joined_on_error(timeout_s: float = 300.0) -> Iterator[None]:
    """On an error in the block, wait (at most ``timeout_s``) for the threads started in it, then re-raise.

    A process exiting while MONAI's cache-fill threads are inside torch code aborts (exit 134).
    """
    before = set(threading.enumerate())
    try:
        yield
    except BaseException:
        deadline = time.monotonic() + timeout_s
        for t in set(threading.enumerate()) - before:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        raise
