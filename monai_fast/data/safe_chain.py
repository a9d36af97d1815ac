"""Transform chains that name the file they fail on, and cache fills that end cleanly (docs/data.md)."""

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
