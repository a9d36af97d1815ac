"""A competing CPU job for the benchmarks that compare a quiet host with a loaded one.

``busy_cores(n)`` runs ``n`` busy-loop processes (one per core is a host whose every core is wanted
by someone else) for the duration of a ``with`` block and ends them when it exits, also on an
error. Used by ``demo_under_load.py``, ``openmp_spin.py`` and ``openmp_step_under_load.py``.

    with busy_cores(os.cpu_count()):
        ...  # timed under load
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from contextlib import contextmanager


def _spin() -> None:
    while True:
        pass


@contextmanager
def busy_cores(n: int) -> Iterator[None]:
    """``n`` busy-loop processes while the block runs (``n = 0``: none)."""
    procs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join(timeout=30)
