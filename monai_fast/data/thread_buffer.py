"""The background thread under `SafeThreadDataLoader`: items made ahead or on demand (docs/data.md)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from queue import Empty, Full, Queue
from typing import Any

from monai_fast.data.items import LoaderTimeoutError
from monai_fast.openmp import serial_openmp_here
from monai_fast.telemetry.cuda import current_cuda_device, set_cuda_device
from monai_fast.threads import forget_at_exit, stop_at_exit

__all__ = ["SafeThreadBuffer"]

logger = logging.getLogger("monai_fast.data.loaders")  # one logger for the loader and its thread

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
        thread: threading.Thread | None = None
        asked = 0  # items asked of the thread and not yet received

        def ask() -> None:
            nonlocal asked, thread
            if thread is None:  # on the training thread's CUDA device at the start of the epoch
                device = current_cuda_device()
                run.thread = threading.Thread(target=self._produce, args=(run, device), name="monai-fast-loader")
                run.thread.daemon = True
                stop_at_exit(run)  # an iteration left open when the run ends is stopped before exit
                run.thread.start()
                thread = run.thread
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
                    value = self._receive(run, thread)
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
            if thread is None:
                run.close()
            else:  # the thread closes the iterator as it stops
                thread.join(0 if run.stuck else self.timeout_s)
                if thread.is_alive():
                    thread.name = "monai-fast-loader (abandoned)"
                    logger.warning("the loader thread did not stop; it is left behind as a daemon thread")
                else:
                    forget_at_exit(run)

    def _prefetch_now(self) -> bool:
        return bool(self.prefetch() if callable(self.prefetch) else self.prefetch)

    def _doing(self) -> str:
        return self.working_on() if self.working_on is not None else "working"

    def _receive(self, run: _Run, thread: threading.Thread | None) -> Any:
        """The next item from the loader thread, waiting at most ``timeout_s``."""
        start = time.monotonic()
        while True:
            try:
                return run.queue.get(timeout=self.timeout)
            except Empty:
                if thread is None or not thread.is_alive() and run.queue.empty():
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
