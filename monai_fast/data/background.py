"""A cache that fills in the background while training draws from what is cached (docs/data.md).

Uses MONAI's private ``CacheDataset._load_cache_item``, the one way to run an item's cached part as MONAI does.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from monai.data import CacheDataset
from torch.utils.data import RandomSampler, Sampler, SequentialSampler

from monai_fast.data.items import DataItemError, describe_item, error_text
from monai_fast.openmp import serial_openmp_here
from monai_fast.telemetry.cuda import cuda_available, current_cuda_device, set_cuda_device, side_stream
from monai_fast.threads import forget_at_exit, stop_at_exit

__all__ = ["BackgroundCacheDataset", "FillOrderSampler", "fill_order_options"]

logger = logging.getLogger("monai_fast.data")

_PENDING, _CLAIMED, _DONE = 0, 1, 2
JOIN_S = 300.0  # the longest wait, on failure or exit, for fill threads to finish their item


class _Fill:
    """The cache's container (MONAI's ``runtime_cache``) and the threads filling it."""

    def __init__(
        self,
        load: Callable[[int], Any],
        describe: Callable[[int], str],
        workers: int,
        device: torch.device | None,
        after: _Fill | None,
    ) -> None:
        self.load, self.describe, self.workers, self.device, self.after = load, describe, workers, device, after
        self.items: list[Any] = []
        self.state: list[int] = []
        self.cursor = 0  # every index below is claimed or done
        self.done = 0
        self.error: tuple[int, BaseException] | None = None
        self.cond = threading.Condition()
        self.halt = threading.Event()
        self.threads: list[threading.Thread] = []
        self.pid = os.getpid()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        index = index % len(self.items)
        with self.cond:
            while True:
                self._check()
                if self.state[index] == _DONE:
                    return self.items[index]
                if self.state[index] == _PENDING:
                    self.state[index] = _CLAIMED
                    break
                self.cond.wait(0.1)
        self._make(index)
        with self.cond:
            self._check()
            return self.items[index]

    def __setitem__(self, index: int, value: Any) -> None:
        self._store(index, value)

    @property
    def complete(self) -> bool:
        return self.done == len(self.items)

    def start(self, n: int) -> None:
        self.items, self.state, self.cursor, self.done = [None] * n, [_PENDING] * n, 0, 0
        if self.device is None:
            self.device = current_cuda_device()
        self.threads = [
            threading.Thread(target=self._run, name=f"monai-fast-fill-{i}", daemon=True)
            for i in range(min(self.workers, n))
        ]
        for t in self.threads:
            t.start()
        stop_at_exit(self)  # a thread inside torch code at interpreter exit aborts the process

    def _make(self, index: int) -> None:
        try:
            with side_stream(self.device):
                item = self.load(index)
        except BaseException as e:
            with self.cond:
                self.error = self.error or (index, e)
                self.halt.set()
                self.cond.notify_all()
            return
        self._store(index, item)

    def _store(self, index: int, item: Any) -> None:
        with self.cond:
            if self.state[index] != _DONE:
                self.done += 1
            self.items[index], self.state[index] = item, _DONE
            self.cond.notify_all()

    def _claim(self) -> int | None:
        with self.cond:
            while self.cursor < len(self.state) and self.state[self.cursor] != _PENDING:
                self.cursor += 1
            if self.halt.is_set() or self.cursor == len(self.state):
                return None
            self.state[self.cursor] = _CLAIMED
            return self.cursor

    def _run(self) -> None:
        if self.device is not None:
            set_cuda_device(self.device)  # a new thread starts on cuda:0
        elif not cuda_available():  # the steps run on the CPU's cores: no OpenMP team of its own (serial_openmp_here)
            serial_openmp_here()
        if self.after is not None:
            self.after.wait_quietly(self.halt)
        while (index := self._claim()) is not None:
            self._make(index)

    def _check(self) -> None:
        """Raise the fill's failure, named (``cond`` held; the threads are joined outside it)."""
        if self.error is None and (self.pid == os.getpid() or self.complete):
            return
        self.cond.release()
        try:
            if self.pid != os.getpid():
                raise RuntimeError(
                    "a background cache fill runs in the process that made the data set; a loader worker "
                    "process cannot read it before it is complete: use num_workers=0 (a thread loader)"
                )
            self.stop(JOIN_S)
            index, error = self.error  # type: ignore[misc]
            text = f"background cache fill of {self.describe(index)} failed: {error_text(error)}"
            raise DataItemError(text, reason=text) from error
        finally:
            self.cond.acquire()

    def pick(self, pending: Sequence[int]) -> int:
        """Position in ``pending`` of the next index to hand out: the first cached, else the first not started,
        else the first to finish."""
        with self.cond:
            while True:
                self._check()
                unstarted = None
                for k, i in enumerate(pending):
                    state = self.state[i] if 0 <= i < len(self.state) else _DONE  # uncached: never waits
                    if state == _DONE:
                        return k
                    if state == _PENDING and unstarted is None:
                        unstarted = k
                if unstarted is not None:
                    return unstarted
                self.cond.wait(0.1)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the cache is full (``True``) or ``timeout_s`` passed (``False``); raise the fill's failure."""
        with self.cond:
            self.cond.wait_for(lambda: self.complete or self.error is not None or self.halt.is_set(), timeout_s)
            self._check()
            return self.complete

    def wait_quietly(self, halt: threading.Event) -> None:
        """Wait until this fill is complete, failed or stopped, or ``halt`` is set."""
        with self.cond:
            while not (self.complete or self.halt.is_set() or halt.is_set()):
                self.cond.wait(0.1)

    def stop_for_exit(self) -> None:
        self.stop(JOIN_S)

    def stop(self, join_s: float = JOIN_S) -> None:
        """Stop claiming items; wait at most ``join_s`` for each thread to finish the one it is on."""
        self.halt.set()
        with self.cond:
            self.cond.notify_all()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(join_s)
                if t.is_alive():
                    logger.warning(
                        "background cache fill: %s still busy after %.0f s; left behind (daemon)", t.name, join_s
                    )
        forget_at_exit(self)


class BackgroundCacheDataset(CacheDataset):
    """A ``CacheDataset`` that fills MONAI's ``runtime_cache`` container on threads from construction on.

    Args:
        data: the items, as for ``CacheDataset``.
        transform: the chain; the part before the first random transform is cached.
        *args: further positional arguments of ``CacheDataset`` (``cache_num``, ``cache_rate``, ...).
        num_workers: fill threads; default all CPUs but one (the training thread's), at least 1.
        device: a CUDA device the chain copies to: the fill threads run there, on a side stream.
        after: another background cache whose fill completes before this one starts.
        **kwargs: further keyword arguments of ``CacheDataset``; ``hash_as_key`` and ``runtime_cache`` raise
            ``ValueError`` (this class decides them).

    Examples:
        >>> ds = BackgroundCacheDataset(files, transforms, copy_cache=False)  # doctest: +SKIP
    """

    def __init__(
        self,
        data: Sequence,
        transform: Any = None,
        *args: Any,
        num_workers: int | None = None,
        device: str | torch.device | None = None,
        after: BackgroundCacheDataset | None = None,
        **kwargs: Any,
    ) -> None:
        for bad in ("hash_as_key", "runtime_cache"):
            if kwargs.pop(bad, None):
                raise ValueError(f"BackgroundCacheDataset decides {bad}; do not pass it")
        workers = max(1, (os.cpu_count() or 2) - 1) if num_workers is None else max(1, int(num_workers))
        dev = torch.device(device) if device is not None else None
        # made before MONAI's constructor, which calls set_data()
        self.fill = _Fill(
            self._load_cache_item,
            lambda i: describe_item(self, i),
            workers,
            dev if dev is not None and dev.type == "cuda" else None,
            None if after is None else after.fill,
        )
        super().__init__(data, transform, *args, num_workers=workers, runtime_cache=self.fill, **kwargs)

    def set_data(self, data: Sequence) -> None:
        """New items: stop the running fill, then fill the new ones in the background."""
        if self.fill.threads:  # a new container (MONAI reads ``runtime_cache``), the old threads gone
            old = self.fill
            old.stop()
            self.fill = _Fill(old.load, old.describe, old.workers, old.device, old.after)
            self.runtime_cache = self.fill
        super().set_data(data)
        self.fill.start(self.cache_num)

    @property
    def complete(self) -> bool:
        """Whether every item is cached."""
        return self.fill.complete

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the cache is full; ``False`` when ``timeout_s`` ran out first.

        Raises:
            DataItemError: the fill failed; names the item.
        """
        return self.fill.wait(timeout_s)

    def shutdown(self, join_s: float = JOIN_S) -> None:
        """Stop the fill (each thread finishes its item); reads of missing items then make them in the reader."""
        self.fill.stop(join_s)


class FillOrderSampler(Sampler[int]):
    """``sampler``'s order, but an epoch that starts before ``dataset`` is full hands out cached items first.

    Args:
        sampler: the loader's sampler (``RandomSampler``, ``SequentialSampler``, a ``DistributedSampler``...).
        dataset: a `BackgroundCacheDataset`; any other data set leaves ``sampler``'s order unchanged.
    """

    def __init__(self, sampler: Iterable[int], dataset: Any) -> None:
        self.sampler, self.dataset = sampler, dataset
        self.partial_epochs = 0  #: epochs that started before the cache was full

    def __iter__(self) -> Iterator[int]:
        order = list(self.sampler)  # the sampler's own draw for this epoch, the same random numbers
        fill = getattr(self.dataset, "fill", None)
        if not isinstance(fill, _Fill) or fill.complete:
            yield from order
            return
        self.partial_epochs += 1
        while order:
            yield order.pop(fill.pick(order))

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Passed on to a sampler that has it (``DistributedSampler``)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def fill_order_options(dataset: Any, shuffle: bool, generator: torch.Generator | None = None) -> dict[str, Any]:
    """Loader keyword arguments for ``dataset`` (over a background cache, a `FillOrderSampler`) that draw
    the order of ``DataLoader(dataset, shuffle=shuffle, generator=generator)``.

    Examples:
        >>> loader = SafeThreadDataLoader(ds, batch_size=2, **fill_order_options(ds, shuffle=True))  # doctest: +SKIP
    """
    if not isinstance(dataset, BackgroundCacheDataset):
        return {"shuffle": shuffle, "generator": generator}
    inner = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
    return {"sampler": FillOrderSampler(inner, dataset), "generator": generator}
