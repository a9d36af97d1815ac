"""GNU OpenMP's threads made to share a busy host well: their spin bounded, the main team's workers pinned.

`bound_openmp_spin()` bounds the spin before torch loads libgomp; `pin_openmp_workers()` gives each worker a core
and `on_core()` keeps the main thread on the free one; `serial_openmp_here()` keeps a helper thread from forming a
team. None changes a result (docs/data.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "BOUNDED_SPINCOUNT",
    "LOCAL_RANKS_ENV",
    "PIN_ENV",
    "SPIN_ENV",
    "USER_BINDING_ENV",
    "WAIT_POLICY_ENV",
    "bound_openmp_spin",
    "free_core",
    "libgomp_mapped",
    "main_thread_core",
    "on_core",
    "openmp_loaded",
    "physical_cores",
    "pin_openmp_workers",
    "serial_openmp_here",
]

logger = logging.getLogger("monai_fast.openmp")

#: the variable libgomp reads for the rounds a waiting thread spins before it sleeps
SPIN_ENV = "GOMP_SPINCOUNT"
#: OpenMP's standard wait-policy variable; when set, libgomp derives the spin count from it
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
#: the spin bound ``monai-fast`` sets (libgomp's own default is 300000)
BOUNDED_SPINCOUNT = 10000
#: ``0`` leaves OpenMP's worker threads to the scheduler (`pin_openmp_workers()`)
PIN_ENV = "MONAI_FAST_PIN_OPENMP"
#: OpenMP thread binding the user chose; any of them set: nothing is pinned
USER_BINDING_ENV = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
#: launchers' count of processes on this node; above 1: nothing is pinned
LOCAL_RANKS_ENV = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE")


def _mapped_runtimes() -> list[str]:
    """The OpenMP runtimes (libgomp, libiomp5, libomp) mapped in this process (none off Linux)."""
    try:
        maps = os.fsdecode(Path("/proc/self/maps").read_bytes())
    except OSError:  # not Linux: no /proc
        return []
    # a mapping's path is its sixth field (it may hold spaces); wheels add a hash to a runtime's name
    pattern = r"^(?:\S+\s+){5}(/.*/lib(?:gomp|iomp5|omp)(?:-[0-9a-f]+)?\.so(?:\.\d+)*)(?: \(deleted\))?$"
    return list(dict.fromkeys(re.findall(pattern, maps, re.MULTILINE)))


def libgomp_mapped() -> bool:
    """Whether GNU OpenMP's library is loaded in this process (``False`` off Linux)."""
    return any("/libgomp" in path for path in _mapped_runtimes())


def serial_openmp_here() -> bool:
    """Run the calling thread's OpenMP parallel regions on that thread alone.

    A helper thread that ran torch's parallel code (a loader thread) keeps an OpenMP team while it lives;
    with more OpenMP threads than cores every team sleeps at its barriers (docs/data.md). This calls the
    runtime's per-thread ``omp_set_num_threads(1)`` (``torch.set_num_threads`` is process-wide).

    Returns:
        Whether a runtime's count was set (``False`` off Linux, without such a runtime, or on any failure).
    """
    try:
        mapped = _mapped_runtimes()
        if not mapped:
            return False
        import torch

        home = Path(torch.__file__).resolve().parent
        # the runtime torch ships, else every libgomp: starting another (Intel's, LLVM's) aborts the process
        shipped = [p for p in mapped if Path(p).resolve().parent in (home / "lib", home.parent / "torch.libs")]
        runtimes = shipped or [p for p in mapped if "/libgomp" in p]
        torch.get_num_threads()  # torch sets a new thread's count at its first parallel call: before ours, not after
        for path in runtimes:
            ctypes.CDLL(path).omp_set_num_threads(1)
        return bool(runtimes)
    except Exception:  # noqa: BLE001 - a helper thread keeps its team rather than fail the work it does
        logger.debug("serial_openmp_here: the thread keeps its OpenMP team", exc_info=True)
        return False


def openmp_loaded() -> bool:
    """Whether libgomp may already have read its settings in this process (torch imported, or libgomp mapped)."""
    return "torch" in sys.modules or libgomp_mapped()


def bound_openmp_spin(environ: MutableMapping[str, str] | None = None, loaded: bool | None = None) -> str | None:
    """Set ``GOMP_SPINCOUNT`` to `BOUNDED_SPINCOUNT` where that still takes effect and nobody chose otherwise.

    Args:
        environ: the environment to set it in (default ``os.environ``: this process and its children).
        loaded: whether libgomp has loaded already (default: `openmp_loaded()`); then nothing is set.

    Returns:
        The line to log when it set the variable, else ``None`` (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``
        already set, or libgomp loaded).

    Examples:
        >>> bound_openmp_spin({}, loaded=False)
        'OpenMP threads spin at most 10000 rounds before sleeping (GOMP_SPINCOUNT; set it to choose another value)'
    """
    env = os.environ if environ is None else environ
    if SPIN_ENV in env or WAIT_POLICY_ENV in env or (openmp_loaded() if loaded is None else loaded):
        return None
    env[SPIN_ENV] = str(BOUNDED_SPINCOUNT)
    return (
        f"OpenMP threads spin at most {BOUNDED_SPINCOUNT} rounds before sleeping ({SPIN_ENV}; set it to choose "
        "another value)"
    )


def physical_cores(allowed: set[int] | None = None) -> list[frozenset[int]]:
    """The cores this process may run on, each the set of its logical CPUs (SMT siblings) within ``allowed``.

    Read from ``/sys/devices/system/cpu/cpuN/topology``; where that is missing each logical CPU is a core.

    Args:
        allowed: logical CPUs to consider (default: this process's affinity, ``os.sched_getaffinity(0)``).
    """
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    cores: dict[frozenset[int], None] = {}
    for cpu in sorted(allowed):
        siblings = _parse_cpu_list(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores[frozenset((siblings or {cpu}) & allowed)] = None
    return list(cores)


def _parse_cpu_list(path: str) -> set[int] | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def pin_openmp_workers(environ: Mapping[str, str] | None = None) -> str | None:
    """Keep the main OpenMP team's worker threads on separate cores; the main thread stays free.

    Call it from the main thread at a process's start, after torch loaded and before other threads
    start: worker ``k`` gets core ``k`` (`physical_cores()`), core 0 stays the main thread's. It pins
    only on Linux, with torch's threads equal to the process's cores (more than one), one process per
    node (`LOCAL_RANKS_ENV`), and none of `USER_BINDING_ENV` set nor ``MONAI_FAST_PIN_OPENMP=0``.

    Args:
        environ: the environment to read those variables from (default ``os.environ``).

    Returns:
        The line to log when it pinned, else ``None``.
    """
    env = os.environ if environ is None else environ
    if env.get(PIN_ENV, "1") == "0" or any(env.get(k) for k in USER_BINDING_ENV):
        return None
    if any(_int(env.get(k)) > 1 for k in LOCAL_RANKS_ENV):
        return None
    if not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").is_dir() or not libgomp_mapped():
        return None
    import torch

    cores = physical_cores()
    threads = torch.get_num_threads()
    if len(cores) < 2 or threads != len(cores):
        return None
    before = _thread_ids()
    torch.ones(threads * 65536).mul_(2.0)  # a parallel region: libgomp starts its team's workers
    workers = sorted(_thread_ids() - before)
    if len(workers) != threads - 1:  # not one new thread per worker: something else started threads too
        return None
    for tid, core in zip(workers, cores[1:]):
        os.sched_setaffinity(tid, core)
    return (
        f"OpenMP's {len(workers)} worker thread(s) pinned one per core, the main thread free "
        f"({PIN_ENV}=0 to leave them to the scheduler)"
    )


def _int(value: str | None) -> int:
    """The leading integer of ``value`` (SLURM writes ``2(x3)`` for 2 tasks on each of 3 nodes); 0 when none."""
    digits = re.match(r"\s*(\d+)", value or "")
    return int(digits[1]) if digits else 0


def free_core(process_cpus: set[int] | None = None) -> frozenset[int] | None:
    """The first core of this process that none of its pinned threads holds: where its main thread computes.

    A thread is pinned when its CPU mask is narrower than the process's; ``None`` when none is or every core is held.

    Args:
        process_cpus: the process's CPUs (default: the calling thread's mask; call it while that is the whole set).
    """
    full = set(os.sched_getaffinity(0)) if process_cpus is None else set(process_cpus)
    taken: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            mask = set(os.sched_getaffinity(int(tid)))
        except OSError:  # the thread ended meanwhile
            continue
        if mask < full:
            taken |= mask
    if not taken:
        return None
    return next((core for core in physical_cores(full) if not core & taken), None)


def main_thread_core() -> frozenset[int] | None:
    """`free_core()` on the main thread, else ``None`` (a background validation keeps its mask)."""
    return free_core() if threading.current_thread() is threading.main_thread() else None


@contextmanager
def on_core(core: frozenset[int] | None) -> Iterator[None]:
    """Run the calling thread on ``core`` inside the block, then give it its whole mask back (``None``: no change).

    Threads and processes started inside inherit the one-core mask: the block should only compute.
    """
    if core is None:
        yield
        return
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, core)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mask)
