"""A ``ThreadDataLoader`` that never hides a failing item, where MONAI's ends the epoch early, and the
background thread under it, `SafeThreadBuffer`: items made ahead or on demand (docs/data.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from queue import Empty, Full, Queue
from typing import Any

import torch
from monai.data import ThreadDataLoader
from torch.utils.data import DataLoader, Dataset, IterableDataset

from monai_fast.data.items import DataItemError, LoaderTimeoutError, describe_item, fetch_item, worker_item_error
from monai_fast.openmp import serial_openmp_here
from monai_fast.telemetry.cuda import current_cuda_device, set_cuda_device
from monai_fast.threads import forget_at_exit, stop_at_exit

__all__ = ["DataItemError", "SafeThreadBuffer", "SafeThreadDataLoader", "prefetch_pays"]

logger = logging.getLogger(__name__)

_IDLE_CHECK_S = 5.0  # an idle loader thread re-checks the stop flag this often (a stop also wakes it)
_EXIT_JOIN_S = 120.0  # at interpreter exit, the longest wait for a loader thread to finish its item (no timeout_s)
_END = object()  # the end of ``src``


@dataclass
class _Failure:
    error: BaseException


class _Run:
    """One iteration of a `SafeThreadBuffer`: its iterator, queue, requests and stop flag."""

    def __init__(self, it: Iterator[Any], size: int, timeout: float, exit_join_s: float) -> None:
        self.it, self.timeout, self.exit_join_s = it, timeout, exit_join_s
        self.queue: Queue = Queue(size)  # never fuller than the requests, at most ``size``
        self.asked = threading.Semaphore(0)  # one release per item the consumer asks for
        self.running = True
        self.stuck = False  # the consumer gave up waiting: the thread is not waited for
        self.thread: threading.Thread | None = None

    def put(self, value: Any) -> bool:
        while self.running:
            with contextlib.suppress(Full):
                self.queue.put(value, timeout=self.timeout)
                return True
        return False

    def wait_for_request(self) -> bool:
        """Sleep until the consumer asks for an item (no polling: that takes the GIL from the step); ``False``
        once it has stopped."""
        while self.running:
            if self.asked.acquire(timeout=_IDLE_CHECK_S):
                return self.running
        return False

    def stop(self) -> None:
        self.running = False
        self.asked.release()

    def stop_for_exit(self) -> None:
        """Stop and join the loader thread of an iteration left open, before the interpreter exits."""
        self.stop()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread() and not self.stuck:
            thread.join(self.exit_join_s)
            if thread.is_alive():
                logger.warning("at exit: the loader thread is still busy after %.0f s; left behind", self.exit_join_s)

    def close(self) -> None:
        if hasattr(self.it, "close"):  # a generator's clean-up (worker shutdown) runs now, not at GC
            self.it.close()


class _Watchdog:
    """One thread per epoch (not one per item) calling ``on_stuck(since)`` for an item made past ``timeout_s``."""

    def __init__(self, timeout_s: float, on_stuck: Callable[[float], None]) -> None:
        self.timeout_s, self.on_stuck = timeout_s, on_stuck
        self.changed = threading.Condition()
        self.since: float | None = None  # when the item being made was begun; None: none is
        self.running = True
        self.thread: threading.Thread | None = None

    def begin(self) -> None:
        with self.changed:
            self.since = time.monotonic()
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="monai-fast-watchdog", daemon=True)
                self.thread.start()
            self.changed.notify()

    def end(self) -> None:
        with self.changed:
            self.since = None

    def stop(self) -> None:
        with self.changed:
            self.running = False
            self.changed.notify()
        if self.thread is not None:
            self.thread.join()

    def _watch(self) -> None:
        with self.changed:
            while self.running:
                since = self.since
                if since is None:
                    self.changed.wait()
                    continue
                left = since + self.timeout_s - time.monotonic()
                if left > 0:
                    self.changed.wait(left)
                    continue
                self.changed.release()  # the consumer's begin/end never wait for the log line
                try:
                    self.on_stuck(since)
                finally:
                    self.changed.acquire()
                while self.running and self.since == since:  # once per item
                    self.changed.wait()


@dataclass(eq=False, repr=False)
class SafeThreadBuffer:
    """Iterates ``src`` in a background thread, or item by item in the consumer's; errors reach the consumer.

    Args:
        src: the iterable to run.
        buffer_size: items queued ahead.
        timeout: seconds per wait on the queue before re-checking the thread.
        timeout_s: the longest wait for one item before `LoaderTimeoutError`; ``None``: as long as the thread lives.
        working_on: what the thread is doing, for the timeout message.
        prefetch: ``True``: items made ahead; ``False``: each made when asked for; a callable: asked at each item.

    Examples:
        >>> list(SafeThreadBuffer(range(3), timeout_s=60, prefetch=False))
        [0, 1, 2]
    """

    src: Iterable[Any]
    buffer_size: int = 1
    timeout: float = 0.01
    timeout_s: float | None = None
    working_on: Callable[[], str] | None = None
    prefetch: bool | Callable[[], bool] = True

    def __post_init__(self) -> None:
        if self.buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {self.buffer_size}")

    def _produce(self, run: _Run, device: Any) -> None:
        try:
            if device is not None:  # a new thread starts on cuda:0, whatever device the trainer uses
                set_cuda_device(device)
            else:  # the step computes on the CPU's cores: a team of this thread's would slow it, even idle
                serial_openmp_here()
            while run.wait_for_request():
                try:
                    value = next(run.it)
                except StopIteration:
                    run.put(_END)
                    return
                if not run.put(value):
                    return
        except BaseException as e:  # handed to the consumer, which raises it in the training thread
            run.put(_Failure(e))
        finally:
            run.close()

    def __iter__(self) -> Iterator[Any]:
        # this run's own iterator, queue and signals: a thread abandoned by an earlier run cannot touch them
        exit_join_s = _EXIT_JOIN_S if self.timeout_s is None else self.timeout_s
        run = _Run(iter(self.src), self.buffer_size, self.timeout, exit_join_s)
        asked = 0  # items asked of the thread and not yet received

        def ask() -> None:
            nonlocal asked
            if run.thread is None:  # on the training thread's CUDA device at the start of the epoch
                device = current_cuda_device()
                thread = threading.Thread(
                    target=self._produce, args=(run, device), name="monai-fast-loader", daemon=True
                )
                stop_at_exit(run)  # an iteration left open when the run ends is stopped before exit
                thread.start()
                run.thread = thread  # only once started: the `finally` below joins a started thread
            asked += 1
            run.asked.release()

        watchdog = _Watchdog(self.timeout_s, self._log_stuck) if self.timeout_s is not None else None
        try:
            if self._prefetch_now():
                ask()
            while True:
                if asked == 0:  # made here, while the consumer waits for it
                    value = self._make_here(run.it, watchdog)
                else:
                    value = self._receive(run)
                    asked -= 1
                if value is _END:
                    return
                if isinstance(value, _Failure):
                    raise value.error
                if self._prefetch_now():
                    while asked < self.buffer_size:  # made while the consumer works on this one
                        ask()
                yield value
        finally:
            if watchdog is not None:
                watchdog.stop()
            run.stop()  # wakes a waiting loader thread, which sees the stop
            if run.thread is None:
                run.close()
            else:  # the thread closes the iterator as it stops
                run.thread.join(0 if run.stuck else self.timeout_s)
                if run.thread.is_alive():
                    run.thread.name = "monai-fast-loader (abandoned)"
                    logger.warning("the loader thread did not stop; it is left behind as a daemon thread")
                else:
                    forget_at_exit(run)

    def _prefetch_now(self) -> bool:
        return bool(self.prefetch() if callable(self.prefetch) else self.prefetch)

    def _doing(self) -> str:
        return self.working_on() if self.working_on is not None else "working"

    def _receive(self, run: _Run) -> Any:
        """The next item from the loader thread, waiting at most ``timeout_s``."""
        start = time.monotonic()
        while True:
            try:
                return run.queue.get(timeout=self.timeout)
            except Empty:
                if run.thread is None or not run.thread.is_alive() and run.queue.empty():
                    raise RuntimeError(
                        "the loader thread stopped without finishing its epoch or reporting an error"
                    ) from None
                waited = time.monotonic() - start
                if self.timeout_s is not None and waited > self.timeout_s:
                    run.stuck = True
                    raise LoaderTimeoutError(
                        f"no batch from the loader thread within timeout_s={self.timeout_s:g} s ({waited:.1f} s "
                        f"waited): it has been {self._doing()}. A Python thread cannot be stopped: it is left behind "
                        "as a daemon. If the data is only slow, raise timeout_s (None turns the watchdog off)."
                    ) from None

    def _make_here(self, it: Iterator[Any], watchdog: _Watchdog | None) -> Any:
        """The next item, made in the consumer's thread (not interruptible: past ``timeout_s`` it is only logged)."""
        if watchdog is not None:
            watchdog.begin()
        try:
            return next(it)
        except StopIteration:
            return _END
        finally:
            if watchdog is not None:
                watchdog.end()

    def _log_stuck(self, since: float) -> None:
        logger.error(
            "no batch within timeout_s=%g s (%.1f s so far): the training thread has been %s; a batch made "
            "on demand cannot be interrupted (prefetch=True makes it in the loader thread, whose watchdog "
            "raises)",
            self.timeout_s,
            time.monotonic() - since,
            self._doing(),
        )


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
        record = _Recorded(self.batch_sampler if self.batch_sampler is not None else self.sampler)
        order = {"batch_sampler": record} if self.batch_sampler is not None else {"batch_size": None, "sampler": record}
        loader = DataLoader(_NamedItems(self.dataset), **order, **options)
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
