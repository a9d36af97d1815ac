"""A ``ThreadDataLoader`` that never hides a failing item.

MONAI's ``ThreadDataLoader`` runs the loader in a background thread (``ThreadBuffer``). When a
transform raises there, the thread dies, the consumer sees "no thread, empty queue", and the
epoch simply ends early: training goes on with fewer batches, and the error never reaches the
training loop. :class:`SafeThreadDataLoader` keeps the thread and the speed, but:

* an exception in the background thread is raised in the training thread, unchanged in type
  when it is not about one item, else as :class:`DataItemError` that names the item's index and
  its file names (``image=/data/imagesTr/spleen_3.nii.gz, label=...``);
* a normal end is marked, so a thread that dies without finishing is an error, not an early end;
* nothing blocks forever: every wait has a timeout and re-checks the thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from queue import Empty, Full, Queue
from typing import Any

import torch
from monai.data import ThreadDataLoader
from torch.utils.data import DataLoader

__all__ = ["DataItemError", "SafeThreadBuffer", "SafeThreadDataLoader", "describe_item", "error_text", "item_files"]


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


class _End:
    pass


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class SafeThreadBuffer:
    """Iterates ``src`` in a background thread; its errors and its end reach the consumer.

    Args:
        src: the iterable to run in the background.
        buffer_size: items queued ahead.
        timeout: seconds per wait on the queue before re-checking the thread.
    """

    def __init__(self, src: Any, buffer_size: int = 1, timeout: float = 0.01) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.src = src
        self.buffer: Queue = Queue(buffer_size)
        self.timeout = timeout
        self._running = False
        self._thread: threading.Thread | None = None

    def _put(self, value: Any) -> bool:
        while self._running:
            try:
                self.buffer.put(value, timeout=self.timeout)
                return True
            except Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for value in self.src:
                if not self._put(value):
                    return
            self._put(_End())
        except BaseException as e:  # handed to the consumer, which raises it in the training thread
            self._put(_Failure(e))

    def __iter__(self) -> Iterator[Any]:
        self._running = True
        self._thread = threading.Thread(target=self._produce, name="monai-fast-loader", daemon=True)
        self._thread.start()
        try:
            while True:
                try:
                    value = self.buffer.get(timeout=self.timeout)
                except Empty:
                    if not self._thread.is_alive() and self.buffer.empty():
                        raise RuntimeError(
                            "the loader thread stopped without finishing its epoch or reporting an error"
                        ) from None
                    continue
                if isinstance(value, _End):
                    return
                if isinstance(value, _Failure):
                    raise value.error
                yield value
        finally:
            self._running = False
            self._thread.join()
            self._thread = None


class SafeThreadDataLoader(ThreadDataLoader):
    """MONAI's ``ThreadDataLoader`` with errors surfaced (see the module docstring).

    Takes the same arguments. With ``num_workers=0`` (the usual set-up on cached data) the batches
    are fetched in the background thread by this class, so a failing item is named; with worker
    processes, PyTorch re-raises the worker's error and this class makes sure it is not lost.

    Example:
        >>> from monai_fast.data.loaders import SafeThreadDataLoader
        >>> loader = SafeThreadDataLoader(cache_ds, batch_size=2, shuffle=True)  # doctest: +SKIP
    """

    def _batches(self) -> Iterator[Any]:
        # DataLoader's single-process fetch, done here so the failing index is known. torch's
        # iterator draws one number from the loader's generator (a base seed for workers) before
        # the sampler draws its order; drawing it too keeps the order equal to DataLoader's
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        if self.batch_sampler is not None:
            for indices in self.batch_sampler:
                yield self.collate_fn([self._fetch(i) for i in indices])
        else:
            for i in self.sampler:
                yield self.collate_fn(self._fetch(i))

    def _fetch(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as e:
            raise DataItemError(f"loading {describe_item(self.dataset, index)} failed: {error_text(e)}") from e

    def __iter__(self) -> Iterator[Any]:
        src = self._batches() if self.num_workers == 0 else DataLoader.__iter__(self)
        for batch in SafeThreadBuffer(src, self.buffer_size, self.buffer_timeout):
            for _ in range(self.repeats):
                yield batch
