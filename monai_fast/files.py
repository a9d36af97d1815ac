"""Ground floor: atomic file writes and monai-fast's cache folder.

Every file monai-fast writes that another process may read (run records, reports, results, tuning
results, checkpoints, cached items, synthetic data) goes through :func:`atomic_write`: the bytes go
to a temporary file beside the target, named ``.<target>.<host>-<pid>.<random>.tmp``, and are
renamed onto the target only once complete (``os.replace``, atomic on POSIX). A reader sees the old
file or the new one, never half of one. A writer killed in the middle leaves its temporary file
behind; :func:`clean_stale_tmp` removes such leftovers once their writer is gone (a dead process
on this host, or older than ``max_age_s`` when written from another host), and every atomic write
cleans the leftovers of its own target first (writers of many files into one folder clean the
folder once instead).

This module imports nothing else of monai-fast.

Example:
    >>> import json, tempfile
    >>> from monai_fast.files import atomic_write, write_json
    >>> folder = tempfile.mkdtemp()
    >>> with atomic_write(folder + "/a.txt") as f:
    ...     _ = f.write("complete or absent")
    >>> p = write_json({"x": 1}, folder + "/b.json")
    >>> json.loads(p.read_text())
    {'x': 1}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["APP", "atomic_write", "cache_root", "clean_stale_tmp", "tmp_path_for", "write_json", "write_text"]

APP = "monai-fast"
_TMP_SUFFIX = ".tmp"
logger = logging.getLogger("monai_fast.files")


def cache_root(create: bool = False) -> Path:
    """monai-fast's cache folder.

    ``$MONAI_FAST_CACHE`` when set and not empty; else ``$XDG_CACHE_HOME/monai-fast`` when that is
    set to an absolute path (the XDG spec says to ignore an empty or relative value); else
    ``~/.cache/monai-fast``.

    Args:
        create: make the folder (and its parents) if it does not exist.
    """
    own = os.environ.get("MONAI_FAST_CACHE", "")
    if own:
        root = Path(own).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
        root = base / APP
    if create:
        root.mkdir(parents=True, exist_ok=True)
    return root


def _host() -> str:
    return socket.gethostname().replace(".", "_").replace("-", "_") or "host"


def tmp_path_for(path: str | os.PathLike) -> Path:
    """A fresh temporary name beside ``path``, in the form :func:`clean_stale_tmp` recognises."""
    path = Path(path)
    return path.with_name(f".{path.name}.{_host()}-{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")


def _writer_gone(tmp: Path, max_age_s: float, now: float) -> bool:
    """Whether the process that wrote ``tmp`` (named by :func:`tmp_path_for`) is gone."""
    parts = tmp.name[: -len(_TMP_SUFFIX)].rsplit(".", 2)
    if len(parts) != 3 or "-" not in parts[1]:
        return False  # not one of ours
    host, _, pid = parts[1].rpartition("-")
    try:
        age = now - tmp.stat().st_mtime
    except FileNotFoundError:
        return False
    if host == _host() and pid.isdigit():
        if int(pid) == os.getpid():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False
    return age > max_age_s


def clean_stale_tmp(folder: str | os.PathLike, target: str | None = None, max_age_s: float = 86400.0) -> list[Path]:
    """Remove temporary files that killed writers left in ``folder``.

    A temporary file is removed when the process that made it no longer runs on this host, or,
    when it was made on another host (a shared file system), when it is older than ``max_age_s``.
    Files of running writers and files not named by :func:`tmp_path_for` are left alone.

    Args:
        folder: the folder to clean (a missing folder is fine).
        target: only leftovers of this file name (e.g. ``"results.json"``).
        max_age_s: age after which another host's leftover counts as stale.

    Returns:
        The paths removed.
    """
    folder = Path(folder)
    pattern = f".{target}.*{_TMP_SUFFIX}" if target else f".*{_TMP_SUFFIX}"
    removed = []
    now = time.time()
    try:
        candidates = list(folder.glob(pattern))
    except OSError:
        return removed
    for tmp in candidates:
        if _writer_gone(tmp, max_age_s, now):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed.append(tmp)
    if removed:
        logger.info("removed %d temporary file(s) left by killed writers in %s", len(removed), folder)
    return removed


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike, mode: str = "w", fsync: bool = False, clean: bool = True, **open_kwargs: Any
) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on a clean exit rename it onto ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was. The parent
    folder is created if needed.

    Args:
        path: the final file.
        mode: ``"w"`` (text) or ``"wb"`` (bytes).
        fsync: flush the file (and the folder's entry) to stable storage before returning: for
            files that must survive a power cut or node loss (checkpoints, tuning results).
        clean: first remove leftovers of killed writers of this file. That lists the folder, so a
            writer of many files into one folder (a disk cache) passes ``False`` and calls
            :func:`clean_stale_tmp` on the folder once instead.
        open_kwargs: passed to :func:`open` (``encoding``, ...).

    Yields:
        The open temporary file. It is created like any new file, so its permissions follow the
        process's umask.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if clean:
        clean_stale_tmp(path.parent, target=path.name)
    tmp = tmp_path_for(path)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be opened and synced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text(text: str, path: str | os.PathLike, fsync: bool = False) -> Path:
    """Write ``text`` to ``path`` atomically; returns ``path``."""
    with atomic_write(path, "w", fsync=fsync, encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def write_json(obj: Any, path: str | os.PathLike, indent: int | None = 2, fsync: bool = False, **dump_kwargs: Any) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically; returns ``path``."""
    with atomic_write(path, "w", fsync=fsync, encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, **dump_kwargs)
    return Path(path)
