"""How much of this host's CPU other processes took during a window: the competing load a timing ran under.

The share is the host's busy CPU time (``/proc/stat`` via psutil: every state but idle and iowait) minus this
process tree's, over the window's wall time times the logical CPUs: two processes spinning on a 2-core host
give about 0.5, a quiet host about 0.
"""

from __future__ import annotations

import time

import psutil

__all__ = ["BUSY_SHARE", "HostLoad", "describe_host_load", "process_tree_cpu_seconds"]

#: from this share of the CPUs taken by other processes on, a measurement is said to be on a busy host
BUSY_SHARE = 0.1


def process_tree_cpu_seconds() -> float:
    """CPU seconds of this process (all threads), its ended children, and its live descendants (loader workers)."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:  # ended meanwhile: counted in children_* once reaped
            continue
        total += c.user + c.system
    return total


def _busy_cpu_s() -> float:
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    return sum(t) - idle


class HostLoad:
    """Measures the share of the host's CPUs that other processes took between `start()` and `stop()`.

    Example:
        >>> load = HostLoad().start()
        >>> sorted(load.stop())
        ['cpus', 'others_cpu_share', 'wall_s']
    """

    def __init__(self) -> None:
        self._start: tuple[float, float, float] | None = None

    def start(self) -> HostLoad:
        """Begin the window (again, if it ran before); returns ``self``."""
        self._start = (time.monotonic(), _busy_cpu_s(), process_tree_cpu_seconds())
        return self

    def stop(self) -> dict:
        """End the window: ``{"others_cpu_share": 0..1, "cpus": N, "wall_s": seconds}``.

        Raises:
            RuntimeError: `start()` was not called.
        """
        if self._start is None:
            raise RuntimeError("HostLoad.stop() before start()")
        t0, busy0, own0 = self._start
        wall, busy, own = time.monotonic() - t0, _busy_cpu_s() - busy0, process_tree_cpu_seconds() - own0
        cpus = psutil.cpu_count() or 1
        share = max(0.0, busy - own) / (wall * cpus) if wall > 0 else 0.0
        return {"others_cpu_share": min(1.0, share), "cpus": cpus, "wall_s": wall}


def describe_host_load(load: dict | None, what: str) -> str:
    """One line on how busy the host was while ``what`` was measured (``load`` from `HostLoad.stop()`)."""
    if not load:
        return "host: load not measured"
    share, cpus = load["others_cpu_share"], load["cpus"]
    if share < BUSY_SHARE:
        return f"host: quiet during {what} (other processes took {100 * share:.0f}% of the {cpus} CPUs)"
    return f"host: other processes took {100 * share:.0f}% of the {cpus} CPUs during {what}: a busy host"
