"""Ground floor: the folders monai-fast owns, a run folder (one run at a time) and the cache folder.

`RunFolderLock` gives a run folder one owner at a time; `cache_root()` says where cached items and tuning
results go. This module imports nothing else of monai-fast.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path

from filelock import FileLock, Timeout

__all__ = ["APP", "LOCK_NAME", "RunFolderBusyError", "RunFolderLock", "cache_root"]

APP = "monai-fast"
LOCK_NAME = ".monai-fast.lock"  #: the lock file `RunFolderLock` holds inside a run folder


def cache_root(create: bool = False) -> Path:
    """monai-fast's cache folder.

    ``$MONAI_FAST_CACHE`` when set and not empty; else ``$XDG_CACHE_HOME/monai-fast`` when that is an
    absolute path (the XDG spec ignores an empty or relative one); else ``~/.cache/monai-fast``.

    Args:
        create: make the folder (and its parents) if it does not exist.
    """
    own, xdg = os.environ.get("MONAI_FAST_CACHE", ""), os.environ.get("XDG_CACHE_HOME", "")
    if own:
        root = Path(own).expanduser()
    else:
        root = (Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / APP
    if create:
        root.mkdir(parents=True, exist_ok=True)
    return root


class RunFolderBusyError(RuntimeError):
    """Another live process owns the run folder; the message names the folder and that process."""


def _sign(fd: int) -> None:
    """Write this process's host, pid and command line into the lock just taken, for a second claimant's message."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n".encode(), 0)


class RunFolderLock:
    """One run per folder at a time: a lock on ``<folder>/.monai-fast.lock`` (or ``name``).

    A `filelock.FileLock` (``fcntl.flock`` on POSIX): the kernel releases it when the owner exits or is
    killed, so a crash never leaves the folder locked. The lock file names the owner's host, pid and
    command line for a second claimant's message; the last release removes it. Taking the lock again in
    the process that holds it, from any thread, is counted (a notebook cell run twice).

    Args:
        folder: the run folder (created if missing).
        what: what owns it, for messages (``"monai-fast train"``).
        name: the lock file's name; ranks of one run that share a folder each take their own
            (``".monai-fast.rank1.lock"``), so two runs clash rank by rank.

    Examples:
        >>> with RunFolderLock("runs/notebook", what="a notebook run"):
        ...     pass
    """

    _held: dict[str, FileLock] = {}  # lock file -> its lock: held until released, even when this object is dropped

    def __init__(self, folder: str | os.PathLike, what: str = "a monai-fast run", name: str = LOCK_NAME) -> None:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"RunFolderLock name must be a plain file name, got {name!r}")
        self.folder, self.what, self.name = Path(folder), what, name
        self._lock: FileLock | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock is not None

    def acquire(self) -> RunFolderLock:
        """Take the lock, or raise `RunFolderBusyError` naming the folder and its owner."""
        if self._lock is not None:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder.resolve() / self.name
        # one instance per file in this process (is_singleton), shared by its threads, counting nested holds
        lock = FileLock(path, timeout=0, thread_local=False, is_singleton=True, on_acquired=_sign)
        try:
            lock.acquire()
        except Timeout:
            owner = ""
            with contextlib.suppress(OSError):
                owner = path.read_text(encoding="utf-8", errors="replace").strip()
            raise RunFolderBusyError(
                f"{self.folder} is in use by another run ({owner or 'owner unknown'}); "
                f"use another folder for {self.what}, or wait for that run to end"
            ) from None
        self._lock = RunFolderLock._held[lock.lock_file] = lock
        return self

    def release(self) -> None:
        """Give the lock back (the last holder in this process frees it and removes the lock file)."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
        if lock.lock_counter == 1:  # removed while still held: a claimant that opened it takes the new one
            RunFolderLock._held.pop(lock.lock_file, None)
            with contextlib.suppress(OSError):
                Path(lock.lock_file).unlink()
        lock.release()

    def __enter__(self) -> RunFolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
