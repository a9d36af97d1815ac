"""A ``ThreadDataLoader`` that never hides a failing item, where MONAI's ends the epoch early (docs/data.md)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from monai.data import ThreadDataLoader
from torch.utils.data import DataLoader, Dataset, IterableDataset

from monai_fast.data.items import DataItemError, LoaderTimeoutError, describe_item, fetch_item, worker_item_error
from monai_fast.data.thread_buffer import SafeThreadBuffer

__all__ = ["DataItemError", "SafeThreadBuffer", "SafeThreadDataLoader", "prefetch_pays"]

logger = logging.getLogger(__name__)

TORCH_TIMEOUT_TEXT = "DataLoader timed out after"  # PyTorch's message when ``timeout=`` runs out
SHUTDOWN_GRACE_S = 30.0  # PyTorch joins, then terminates, each stuck worker (5 s + 5 s) before we raise


class _Progress:
    """What the producing side works on; written by it, read by the watchdog in the training thread."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.batch = 0  # 1-based number, within the epoch, of the batch being made
        self.index: int | None = None  # the item being loaded now; None while collating
        self.since = time.monotonic()

    def start(self, index: int | None) -> None:
        self.index, self.since = index, time.monotonic()

    def text(self) -> str:
        doing = "collating" if self.index is None else f"loading {describe_item(self.dataset, self.index)}"
        return f"{doing} for {time.monotonic() - self.since:.1f} s (batch {self.batch} of the epoch)"


#: ``DataLoader`` options of its worker processes (those this torch has are copied)
WORKER_OPTIONS = (
    "pin_memory",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class _Recorded:
    """An index sampler that remembers what it handed out this epoch (in order)."""

    def __init__(self, sampler: Iterable[Any]) -> None:
        self.sampler = sampler
        self.drawn: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        self.drawn = []
        for x in self.sampler:
            self.drawn.append(x)
            yield x

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


class _NamedItems(Dataset):
    """A data set read through `fetch_item()` in worker processes; MONAI's ``worker_init_fn`` finds (and seeds)
    the random transforms through its ``dataset`` as over the bare data set."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return fetch_item(self.dataset, index)


class SafeThreadDataLoader(ThreadDataLoader):
    """MONAI's ``ThreadDataLoader`` with errors surfaced and a watchdog (docs/data.md).

    Same arguments, plus ``timeout_s`` (seconds one batch may take; ``None``: no watchdog; also PyTorch's
    worker ``timeout`` unless a smaller one is given) and ``prefetch`` (``False``: each batch made in the
    training thread when asked for).

    Examples:
        >>> loader = SafeThreadDataLoader(cache_ds, batch_size=2, shuffle=True, timeout_s=120)  # doctest: +SKIP
    """

    def __init__(
        self, dataset: Any, *args: Any, timeout_s: float | None = 600.0, prefetch: bool = True, **kwargs: Any
    ) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch must be True or False, got {prefetch!r}")
        super().__init__(dataset, *args, **kwargs)
        self.timeout_s = timeout_s
        self.prefetch = prefetch
        self._persistent: tuple[DataLoader, _Recorded] | None = None

    def _batches(self, progress: _Progress) -> Iterator[Any]:
        # DataLoader's single-process fetch, so the failing (or stuck) index is known; the number drawn first is
        # the workers' base seed torch's iterator draws, so the sampler's order equals DataLoader's
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        batched = self.batch_sampler is not None
        for drawn in self.batch_sampler if batched else self.sampler:
            progress.batch += 1
            items = [self._fetch(i, progress) for i in drawn] if batched else self._fetch(drawn, progress)
            progress.start(None)
            batch = self.collate_fn(items)
            # a random crop is a view of its whole (copied) volume: the items must not outlive the collated batch
            del items, drawn
            yield batch

    def _fetch(self, index: int, progress: _Progress) -> Any:
        progress.start(index)
        return fetch_item(self.dataset, index)

    def _worker_timeout(self) -> tuple[float, str]:
        ours = self.timeout_s if self.timeout_s is not None else 0.0
        if self.timeout > 0 and (ours == 0 or self.timeout < ours):
            return float(self.timeout), "timeout"
        return ours, "timeout_s"

    def _worker_loader(self) -> tuple[DataLoader, _Recorded]:
        """A plain ``DataLoader`` over this one's dataset and recorded sampler."""
        if self._persistent is not None:
            return self._persistent
        options = {
            k: getattr(self, k) for k in ("num_workers", "collate_fn", "generator", *WORKER_OPTIONS) if hasattr(self, k)
        }
        options["timeout"] = self._worker_timeout()[0]
        if self.batch_sampler is not None:
            record = _Recorded(self.batch_sampler)
            loader = DataLoader(_NamedItems(self.dataset), batch_sampler=record, **options)
        else:
            record = _Recorded(self.sampler)
            loader = DataLoader(_NamedItems(self.dataset), batch_size=None, sampler=record, **options)
        if self.persistent_workers:
            self._persistent = (loader, record)
        return loader, record

    def _worker_batches(self) -> Iterator[Any]:
        loader, record = self._worker_loader()
        it = iter(loader)
        received = 0
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except RuntimeError as e:
                named = worker_item_error(e)  # a worker's failing item: its own message, not the whole traceback text
                if named is None and TORCH_TIMEOUT_TEXT not in str(e):
                    raise
                cause = e.with_traceback(None) if named is not None else None  # its frames would hold the iterator
                break
            received += 1
            yield batch
        # dropping the iterator shuts PyTorch's workers down now (a stuck one terminated), not at garbage collection
        self._persistent = None
        del it, loader
        if named is not None:
            raise named from cause
        raise LoaderTimeoutError(self._worker_timeout_text(record, received)) from None

    def _worker_timeout_text(self, record: _Recorded, received: int) -> str:
        seconds, option = self._worker_timeout()
        where = f"batch {received + 1} of the epoch"
        if getattr(self, "in_order", True) and received < len(record.drawn):  # batches arrive in drawn order
            drawn = record.drawn[received]
            indices = list(drawn) if self.batch_sampler is not None else [drawn]
            named = [describe_item(self.dataset, i) for i in indices[:8]]
            where += f" ({', '.join(named)}{f' and {len(indices) - 8} more' if len(indices) > 8 else ''})"
        return (
            f"no batch from the worker processes within {option}={seconds:g} s: {where} is stuck or too slow in one of "
            f"its items; the workers were stopped. If the data is only slow, raise {option} (timeout_s=None turns the "
            "watchdog off)."
        )

    def __iter__(self) -> Iterator[Any]:
        if self.num_workers == 0:
            progress = _Progress(self.dataset)
            src: Iterable[Any] = self._batches(progress)
            limit, working_on = self.timeout_s, progress.text
        elif isinstance(self.dataset, IterableDataset):
            src, limit, working_on = DataLoader.__iter__(self), None, None
        else:  # PyTorch's own timeout fires first; the thread's watchdog is a backstop
            src = self._worker_batches()
            limit = None if self.timeout_s is None else self.timeout_s + SHUTDOWN_GRACE_S
            working_on = lambda: "waiting for the worker processes"  # noqa: E731
        for batch in SafeThreadBuffer(
            src, self.buffer_size, self.buffer_timeout, limit, working_on, lambda: self.prefetch
        ):
            for _ in range(self.repeats):
                yield batch


def prefetch_pays(device: torch.device | str) -> tuple[bool, str]:
    """Whether making the next batch while the step computes surely pays, and why: on a CUDA device yes;
    on a CPU ``False``, a measurement (`PrefetchChoice`) decides."""
    device = torch.device(device)
    if device.type != "cpu":
        return True, f"the step runs on {device.type}: the next batch is made while it computes"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return False, (
        f"the step runs on the CPU ({torch.get_num_threads()} intra-op threads, {cpus} CPUs): a batch made "
        "alongside it may cost it more than the batch"
    )
