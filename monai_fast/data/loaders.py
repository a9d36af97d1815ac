"""A ``ThreadDataLoader`` that never hides a failing item.

MONAI's ``ThreadDataLoader`` runs the loader in a background thread (``ThreadBuffer``). When a
transform raises there, the thread dies, the consumer sees "no thread, empty queue", and the
epoch simply ends early: training goes on with fewer batches, and the error never reaches the
training loop. :class:`SafeThreadDataLoader` keeps the thread and the speed, but:

* an exception in the background thread is raised in the training thread, unchanged in type
  when it is not about one item, else as :class:`DataItemError` that names the item's index and
  its file names (``image=/data/imagesTr/spleen_3.nii.gz, label=...``);
* a normal end is marked, so a thread that dies without finishing is an error, not an early end;
* nothing blocks forever: every wait has a timeout and re-checks the thread, and a watchdog
  (``timeout_s``, 600 s by default, ``None`` turns it off) raises :class:`LoaderTimeoutError` in the
  training thread when one batch takes longer, naming the item being loaded. A Python thread
  cannot be killed: a thread stuck in a transform is abandoned (a daemon, renamed
  ``monai-fast-loader (abandoned)``) and the error is raised. With worker processes, PyTorch's
  ``timeout=`` is set to ``timeout_s``; its bare "DataLoader timed out" becomes a
  :class:`LoaderTimeoutError` naming the option, the batch and its items, raised after the
  workers are shut down (PyTorch terminates a stuck worker);
* the loader thread runs on the CUDA device the training thread uses when the epoch starts (a
  new thread would otherwise start on ``cuda:0``, so ``ToDeviced("cuda")`` in the chain or
  pinned memory would land on another rank's GPU).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from queue import Empty, Full, Queue
from typing import Any

import torch
from monai.data import ThreadDataLoader
from torch.utils.data import DataLoader, IterableDataset

from monai_fast.data.items import DataItemError, LoaderTimeoutError, describe_item, error_text
from monai_fast.telemetry.cuda import current_cuda_device, set_cuda_device

__all__ = ["SafeThreadBuffer", "SafeThreadDataLoader"]

logger = logging.getLogger(__name__)

TORCH_TIMEOUT_TEXT = "DataLoader timed out after"  # PyTorch's message when ``timeout=`` runs out
SHUTDOWN_GRACE_S = 30.0  # PyTorch joins, then terminates, each stuck worker (5 s + 5 s) before we raise


class _End:
    pass


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


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


class SafeThreadBuffer:
    """Iterates ``src`` in a background thread; its errors and its end reach the consumer.

    Args:
        src: the iterable to run in the background.
        buffer_size: items queued ahead.
        timeout: seconds per wait on the queue before re-checking the thread.
        timeout_s: the longest the consumer waits for one item before :class:`LoaderTimeoutError`
            (the thread, if stuck, is abandoned); ``None`` waits as long as the thread lives.
        working_on: what the thread is doing, for the timeout message.

    Example:
        >>> list(SafeThreadBuffer(range(3), timeout_s=60))
        [0, 1, 2]
    """

    def __init__(
        self,
        src: Iterable[Any],
        buffer_size: int = 1,
        timeout: float = 0.01,
        timeout_s: float | None = None,
        working_on: Callable[[], str] | None = None,
    ) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.src = src
        self.buffer: Queue = Queue(buffer_size)
        self.timeout = timeout
        self.timeout_s = timeout_s
        self.working_on = working_on
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

    def _produce(self, device: Any) -> None:
        try:
            if device is not None:  # a new thread starts on cuda:0, whatever device the trainer uses
                set_cuda_device(device)
            for value in self.src:
                if not self._put(value):
                    return
            self._put(_End())
        except BaseException as e:  # handed to the consumer, which raises it in the training thread
            self._put(_Failure(e))
        finally:
            close = getattr(self.src, "close", None)
            if close is not None:  # a generator's clean-up (worker shutdown) runs here, not at GC
                close()

    def _timed_out(self, waited: float) -> LoaderTimeoutError:
        doing = self.working_on() if self.working_on is not None else "working"
        return LoaderTimeoutError(
            f"no batch from the loader thread within timeout_s={self.timeout_s:g} s ({waited:.1f} s waited): "
            f"it has been {doing}. A Python thread cannot be stopped: it is left behind as a daemon. "
            "If the data is only slow, raise timeout_s (None turns the watchdog off)."
        )

    def __iter__(self) -> Iterator[Any]:
        self._running = True
        device = current_cuda_device()  # the training thread's, at the start of the epoch
        thread = threading.Thread(target=self._produce, args=(device,), name="monai-fast-loader", daemon=True)
        self._thread = thread
        thread.start()
        stuck = False
        try:
            start = time.monotonic()
            while True:
                try:
                    value = self.buffer.get(timeout=self.timeout)
                except Empty:
                    if not thread.is_alive() and self.buffer.empty():
                        raise RuntimeError(
                            "the loader thread stopped without finishing its epoch or reporting an error"
                        ) from None
                    waited = time.monotonic() - start
                    if self.timeout_s is not None and waited > self.timeout_s:
                        stuck = True
                        raise self._timed_out(waited) from None
                    continue
                if isinstance(value, _End):
                    return
                if isinstance(value, _Failure):
                    raise value.error
                yield value
                start = time.monotonic()
        finally:
            self._running = False
            self._thread = None
            thread.join(0 if stuck else self.timeout_s)
            if thread.is_alive():
                thread.name = "monai-fast-loader (abandoned)"
                logger.warning("the loader thread did not stop; it is left behind as a daemon thread")


# DataLoader options copied to the loader that runs the worker processes (those this torch has)
_WORKER_OPTIONS = (
    "num_workers", "collate_fn", "pin_memory", "worker_init_fn", "multiprocessing_context", "generator",
    "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
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


class SafeThreadDataLoader(ThreadDataLoader):
    """MONAI's ``ThreadDataLoader`` with errors surfaced and a watchdog (see the module docstring).

    Takes the same arguments, plus ``timeout_s`` (seconds one batch may take, 600 by default;
    ``None`` turns the watchdog off). With ``num_workers=0`` (the usual set-up on cached data) the
    batches are fetched in the background thread by this class, so a failing or stuck item is named;
    with worker processes, PyTorch re-raises the worker's error and this class makes sure it is not
    lost, and PyTorch's ``timeout`` is set to ``timeout_s`` (a smaller ``timeout=`` wins).

    Example:
        >>> from monai_fast.data.loaders import SafeThreadDataLoader
        >>> loader = SafeThreadDataLoader(cache_ds, batch_size=2, shuffle=True, timeout_s=120)  # doctest: +SKIP
    """

    def __init__(self, dataset: Any, *args: Any, timeout_s: float | None = 600.0, **kwargs: Any) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
        super().__init__(dataset, *args, **kwargs)
        self.timeout_s = timeout_s
        self._persistent: tuple[DataLoader, _Recorded] | None = None

    def _batches(self, progress: _Progress) -> Iterator[Any]:
        # DataLoader's single-process fetch, done here so the failing (or stuck) index is known. torch's
        # iterator draws one number from the loader's generator (a base seed for workers) before the
        # sampler draws its order; drawing it too keeps the order equal to DataLoader's
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        batched = self.batch_sampler is not None
        for drawn in self.batch_sampler if batched else self.sampler:
            progress.batch += 1
            items = [self._fetch(i, progress) for i in drawn] if batched else self._fetch(drawn, progress)
            progress.start(None)
            yield self.collate_fn(items)

    def _fetch(self, index: int, progress: _Progress | None = None) -> Any:
        if progress is not None:
            progress.start(index)
        try:
            return self.dataset[index]
        except Exception as e:
            raise DataItemError(f"loading {describe_item(self.dataset, index)} failed: {error_text(e)}") from e

    def _worker_timeout(self) -> tuple[float, str]:
        ours = self.timeout_s if self.timeout_s is not None else 0.0
        if self.timeout > 0 and (ours == 0 or self.timeout < ours):
            return float(self.timeout), "timeout"
        return ours, "timeout_s"

    def _worker_loader(self) -> tuple[DataLoader, _Recorded]:
        """A plain ``DataLoader`` over this one's dataset and sampler whose batches are recorded."""
        if self._persistent is not None:
            return self._persistent
        options = {k: getattr(self, k) for k in _WORKER_OPTIONS if hasattr(self, k)}
        options["timeout"] = self._worker_timeout()[0]
        if self.batch_sampler is not None:
            record = _Recorded(self.batch_sampler)
            loader = DataLoader(self.dataset, batch_sampler=record, **options)
        else:
            record = _Recorded(self.sampler)
            loader = DataLoader(self.dataset, batch_size=None, sampler=record, **options)
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
                if TORCH_TIMEOUT_TEXT not in str(e):
                    raise
            else:
                received += 1
                yield batch
                continue
            # dropping the iterator makes PyTorch shut its workers down, terminating a stuck one
            self._persistent = None
            del it, loader
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
        for batch in SafeThreadBuffer(src, self.buffer_size, self.buffer_timeout, limit, working_on):
            for _ in range(self.repeats):
                yield batch
