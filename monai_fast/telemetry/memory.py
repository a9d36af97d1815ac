"""Memory readings: peak RSS of a block (the kernel's high-water mark, else sampled), device memory."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import torch

__all__ = ["DeviceMemory", "PeakRSS", "is_out_of_memory"]


class PeakRSS:
    """Context manager: the peak RSS of this process (children not counted) while the block runs.

    On Linux the kernel's peak (``VmHWM``) is reset on entry and read on exit, so a spike of any length counts;
    elsewhere RSS is sampled every ``interval_s``. The reset is process-wide: blocks open together each still see
    their whole span, and other readers of ``VmHWM`` / ``ru_maxrss`` see it restart at each block.

    Example:
        >>> with PeakRSS() as mem:
        ...     buf = bytearray(64 * 2**20)
        >>> mem.growth_mib >= 60
        True
    """

    def __init__(self, interval_s: float = 0.02) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.growth_mib = 0.0
        self.peak_bytes = 0
        self.exact = False  # whether the kernel's high-water mark was used
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self._base = self._peak = self._proc.memory_info().rss
        with _OPEN_LOCK:
            before = _high_water_mark()  # the peak since the last reset: it belongs to the open blocks
            self._hwm = _reset_high_water_mark()
            if self._hwm:
                for other in _OPEN:
                    other._peak = max(other._peak, before or 0)
                _OPEN.append(self)
        if not self._hwm:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="monai-fast-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._peak = max(self._peak, self._proc.memory_info().rss)
        if self._hwm:
            with _OPEN_LOCK:
                _OPEN.remove(self)
                hwm = _high_water_mark()
            if hwm is not None:
                self._peak = max(self._peak, hwm)
                self.exact = True
        self.peak_bytes = int(self._peak)
        self.growth_mib = (self._peak - self._base) / 2**20


# the blocks that rely on the kernel's one peak per process, so a reset can tell them the peak it is about to erase
_OPEN: list[PeakRSS] = []
_OPEN_LOCK = threading.Lock()


def _high_water_mark() -> int | None:
    """The kernel's peak RSS of this process in bytes (Linux ``VmHWM``), or ``None``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_high_water_mark() -> bool:
    """Reset the kernel's peak RSS to the current RSS (Linux >= 4.0); whether that worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _high_water_mark() is not None


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: CUDA OOM, or the CPU allocator / Python out of memory."""
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class DeviceMemory:
    """Memory of the device that runs a trial: live bytes now, and the peak over a block.

    On CUDA torch's caching allocator (``max_memory_reserved``: what runs out); on a CPU this process's
    peak resident set size (`PeakRSS`), after glibc returns freed pages.

    Example:
        >>> mem = DeviceMemory("cpu")
        >>> with mem.peak() as p:
        ...     x = torch.ones(32, 2**20)
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        if self.device.type == "cuda" and not self.cuda:
            raise ValueError(f"device {self.device} is CUDA but torch sees no CUDA device")

    def total_bytes(self) -> int:
        """The device's memory: GPU memory on CUDA, physical RAM on a CPU."""
        if self.cuda:
            return int(torch.cuda.get_device_properties(self.device).total_memory)
        return int(psutil.virtual_memory().total)

    def release(self, full: bool = True) -> None:
        """Collect garbage and return cached/freed memory (CUDA cache, glibc heap).

        Args:
            full: collect all generations (slow in a process that imported MONAI); ``False`` collects only the
                young ones, where a block's garbage sits unless the block raised.
        """
        gc.collect(2 if full else 1)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        with contextlib.suppress(OSError, AttributeError):  # not glibc: RSS readings are just less tight
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back to the OS: RSS shows what is live

    def live_bytes(self) -> int:
        """Bytes in use now: tensors allocated on CUDA, resident set size on a CPU."""
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return int(psutil.Process().memory_info().rss)

    @contextmanager
    def peak(self) -> Iterator[_Peak | PeakRSS]:
        """Context manager yielding an object whose ``peak_bytes`` is set when the block ends."""
        if not self.cuda:
            with PeakRSS(interval_s=0.005) as watcher:
                yield watcher
            return
        result = _Peak()
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield result
        finally:
            torch.cuda.synchronize(self.device)
            result.peak_bytes = int(torch.cuda.max_memory_reserved(self.device))


class _Peak:
    """Holder of the peak reading of a `DeviceMemory.peak()` block."""

    peak_bytes: int = 0
