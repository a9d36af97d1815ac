"""Peak resident memory of this process over a block, sampled on a background thread."""

from __future__ import annotations

import threading

import psutil

__all__ = ["PeakRSS"]


class PeakRSS:
    """Context manager: the peak RSS growth of this process while the block runs.

    RSS is read every ``interval_s`` on a background thread, so a short spike between two
    readings can be missed; the reading at exit is always included. Child processes (DataLoader
    workers) are not counted.

    Example:
        >>> from monai_fast.telemetry.memory import PeakRSS
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
        self._proc = psutil.Process()
        self._stop = threading.Event()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self._base = self._peak = self._proc.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="monai-fast-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._proc.memory_info().rss)
        self.growth_mib = (self._peak - self._base) / 2**20
