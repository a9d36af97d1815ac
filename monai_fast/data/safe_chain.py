"""Transform chains that name the file they fail on, and cache fills that end cleanly.

A file that cannot be read (a truncated NIfTI, say) must end a cache build or an epoch with one
`DataItemError` naming the file, in every cache mode, thread and
loader worker process, and the process must exit like after any other error.

Examples:
    >>> from monai.transforms import LoadImaged
    >>> chain = NamedItemsCompose([LoadImaged(keys="image")])
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from monai.transforms import Compose

from monai_fast.data.items import named_item_errors

__all__ = ["NamedItemsCompose", "threads_joined_on_error"]


class NamedItemsCompose(Compose):
    """A ``Compose`` whose failure on an item that carries file names is a `DataItemError` naming them.

    MONAI's ``RuntimeError("applying transform ...")`` names no file; this chain names it, in any
    thread or worker; items without file names raise as before.

    Examples:
        >>> from monai.transforms import LoadImaged
        >>> chain = NamedItemsCompose([LoadImaged(keys="image")])
        >>> chain({"image": "/no/such.nii.gz"})  # doctest: +SKIP
        DataItemError: transforming image=/no/such.nii.gz failed: ...
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

    MONAI's ``CacheDataset`` fills its cache in a ``ThreadPool`` and, on the first failing item,
    terminates the pool without waiting: its other threads are still inside transforms (torch
    code) while the error unwinds, and a process that exits then aborts ("terminate called without
    an active exception", exit 134). Once they have finished their items they stop, and the error
    ends the process like any other.

    Examples:
        >>> with threads_joined_on_error():  # doctest: +SKIP
        ...     ds = CacheDataset(files, chain, num_workers=4)
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
