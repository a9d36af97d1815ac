"""How long GNU OpenMP's threads spin before they sleep, bounded before torch loads.

PyTorch's Linux wheels run CPU kernels on GNU OpenMP (libgomp). After a parallel region its
threads spin ``GOMP_SPINCOUNT`` rounds (libgomp's own default is 300000) waiting for the next one,
then sleep. On a quiet host that saves a wake-up. When other processes want the cores, a spinning
thread holds a core through the time slice its partner thread needs to finish the region, and a
training step can take several times as long. :data:`BOUNDED_SPINCOUNT` keeps the quiet host's
speed and gives the cores back under load (``benchmarks/openmp_spin.py`` measures both). The spin
count does not change what is computed: how a region's work is split between threads does not
depend on it.

libgomp reads its settings once, when it loads (with torch), so this can only act at a process's
start: the ``monai-fast`` command calls :func:`bound_openmp_spin` before anything imports torch.
A script of one's own does the same by exporting ``GOMP_SPINCOUNT=10000`` before Python starts.
A ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` already set is the user's choice and is left alone.

Example:
    >>> env = {}
    >>> bound_openmp_spin(env, loaded=False)
    'OpenMP threads spin at most 10000 rounds before sleeping (GOMP_SPINCOUNT; set it to choose another value)'
    >>> env
    {'GOMP_SPINCOUNT': '10000'}
    >>> bound_openmp_spin({"OMP_WAIT_POLICY": "ACTIVE"}, loaded=False) is None
    True
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["BOUNDED_SPINCOUNT", "SPIN_ENV", "WAIT_POLICY_ENV", "bound_openmp_spin", "libgomp_mapped", "openmp_loaded"]

#: the variable libgomp reads for the rounds a waiting thread spins before it sleeps
SPIN_ENV = "GOMP_SPINCOUNT"
#: OpenMP's standard wait-policy variable; when set, libgomp derives the spin count from it
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
#: the spin bound ``monai-fast`` sets (libgomp's own default is 300000)
BOUNDED_SPINCOUNT = 10000


def libgomp_mapped() -> bool:
    """Whether GNU OpenMP's library is loaded in this process (read from ``/proc/self/maps``; ``False`` off Linux).

    Example:
        >>> import torch  # doctest: +SKIP
        >>> libgomp_mapped()  # doctest: +SKIP
        True
    """
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: no /proc, and no libgomp to bound
        return False


def openmp_loaded() -> bool:
    """Whether libgomp may already have read its settings in this process (torch imported, or libgomp mapped).

    Example:
        >>> import torch  # doctest: +SKIP
        >>> openmp_loaded()  # doctest: +SKIP
        True
    """
    return "torch" in sys.modules or libgomp_mapped()


def bound_openmp_spin(environ: MutableMapping[str, str] | None = None, loaded: bool | None = None) -> str | None:
    """Set ``GOMP_SPINCOUNT`` to :data:`BOUNDED_SPINCOUNT` where that still takes effect and nobody chose otherwise.

    Args:
        environ: the environment to set it in (default ``os.environ``: this process and its children).
        loaded: whether libgomp has loaded already (default: :func:`openmp_loaded`); then nothing is set.

    Returns:
        The line to log when it set the variable, else ``None`` (a ``GOMP_SPINCOUNT`` or
        ``OMP_WAIT_POLICY`` was already set, or libgomp had loaded).

    Example:
        >>> bound_openmp_spin({"GOMP_SPINCOUNT": "5"}, loaded=False) is None
        True
    """
    env = os.environ if environ is None else environ
    if SPIN_ENV in env or WAIT_POLICY_ENV in env:
        return None
    if openmp_loaded() if loaded is None else loaded:
        return None
    env[SPIN_ENV] = str(BOUNDED_SPINCOUNT)
    return (f"OpenMP threads spin at most {BOUNDED_SPINCOUNT} rounds before sleeping ({SPIN_ENV}; set it to choose "
            "another value)")
