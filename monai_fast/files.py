"""Ground floor: atomic file writes, and a full file system named with the space missing.

`atomic_write()` / `atomic_path()` write beside the target and rename into place (a reader sees the old file or
the new one); `clean_stale_tmp()` removes killed writers' leftovers (docs/faults.md). Imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import socket
import time
from collections.abc import Iterator
from glob import escape as glob_escape
from pathlib import Path
from typing import IO, Any

__all__ = [
    "NoSpaceError",
    "atomic_path",
    "atomic_write",
    "clean_stale_tmp",
    "ensure_free_space",
    "free_bytes",
    "no_space_in",
    "tmp_path_for",
    "write_bytes",
    "write_json",
    "write_text",
]

_TMP_SUFFIX = ".tmp"
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
FULL_BELOW = 256 * 1024  #: a native writer's error with less free than this counts as a full file system
logger = logging.getLogger("monai_fast.files")


def _mib(n: int | float) -> str:
    """``n`` bytes in the unit that shows it best (KiB, MiB or GiB)."""
    for unit, name in ((2**30, "GiB"), (2**20, "MiB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n / 2**10:.1f} KiB"


class NoSpaceError(OSError):
    """A file could not be written for lack of space; the message names the file and the shortfall.

    An `OSError` with ``errno.ENOSPC`` (``EDQUOT`` for a quota), so code that handles ``OSError`` still does.

    Attributes:
        path: the file (or folder) that could not be written.
        needed: bytes the output needs, where known before writing.
        free: bytes free on the file system at the time of the error, where known.
        written: bytes written when the file system filled, where the write had started.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        needed: int | None = None,
        free: int | None = None,
        what: str = "",
        code: int = errno.ENOSPC,
        written: int | None = None,
        detail: str = "",
    ) -> None:
        text = str(path)
        if "\n" in text and needed is None and free is None and written is None:
            # a DataLoader worker re-raises ``type(err)(traceback_text)``: keep the one-line message
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            named = [ln.split("NoSpaceError: ", 1)[1] for ln in lines if "NoSpaceError: " in ln]
            line = named[-1] if named else lines[-1]
            self.path, self.needed, self.free, self.written = Path(line.split(": ", 1)[0]), None, None, None
            super().__init__(code, line)
            return
        self.path, self.needed, self.free, self.written = Path(path), needed, free, written
        problem = "disk quota exceeded" if code == errno.EDQUOT else "no space left on the device"
        parts = [f"{what + ' ' if what else ''}{self.path}: {problem}"]
        if _no_inodes_left(self.path):  # bytes may be free while the file system has no room for another file
            parts.append("the file system has no free inodes (room for files) left, whatever bytes it shows free")
        if needed is not None and free is not None:
            parts.append(f"needs {_mib(needed)}, {_mib(free)} free ({_mib(max(needed - free, 0))} missing)")
        elif needed is not None:
            parts.append(f"needs at least {_mib(needed)}")
        elif free is not None:
            parts.append(f"{_mib(free)} free")
        if written is not None:
            parts.append(
                f"the file system filled after {_mib(written)} of it; the file was not written and "
                f"what it held before is unchanged"
            )
        if detail:
            parts.append(detail)
        super().__init__(code, "; ".join(parts))

    def __str__(self) -> str:
        return str(self.args[1])

    def __reduce__(self):  # picklable across worker processes
        return (_rebuild_no_space, (str(self.path), self.needed, self.free, self.args[1], self.errno, self.written))


def _rebuild_no_space(
    path: str, needed: int | None, free: int | None, message: str, code: int, written: int | None = None
) -> NoSpaceError:
    err = NoSpaceError(path, needed, free, code=code, written=written)
    err.args = (code, message)
    return err


def no_space_in(
    err: BaseException | None, path: str | os.PathLike | None = None, native: bool = False
) -> NoSpaceError | None:
    """The `NoSpaceError` behind ``err``, or ``None`` when ``err`` is not about space.

    Walks ``err``'s chain (``__cause__``, ``__context__``: ``torch.save`` raises a ``RuntimeError`` over the
    ``OSError``) for a `NoSpaceError`, else builds one from the first ``ENOSPC``/``EDQUOT`` error.

    Args:
        err: the exception raised by a write.
        path: the file being written, for the message (else the error's ``filename``, else ``"a file"``).
        native: written from C (no errno): an error while ``path``'s file system has less than `FULL_BELOW`
            bytes free counts as a full one (call it before the partial file is removed).
    """
    found = _space_error_in(err, path if native else None)
    if found is None or isinstance(found, NoSpaceError):
        return found
    target = path if path is not None else (found.filename or "a file")
    free = _free_or_none(target) if (path is not None or found.filename) else None
    return NoSpaceError(target, free=free, code=found.errno)


def _space_error_in(err: BaseException | None, native_path: str | os.PathLike | None = None) -> OSError | None:
    """The first `NoSpaceError`, else ENOSPC/EDQUOT ``OSError``, in ``err``'s chain (``native_path``: `no_space_in`)."""
    seen: set[int] = set()
    found: OSError | None = None
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, NoSpaceError):
            return err
        if found is None and isinstance(err, OSError) and err.errno in _NO_SPACE:
            found = err
        err = err.__cause__ or err.__context__
    if found is None and seen and native_path is not None:
        with contextlib.suppress(OSError):
            if free_bytes(native_path) < FULL_BELOW:
                found = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return found


def _existing(path: str | os.PathLike) -> Path:
    """``path``'s nearest existing folder (itself when it exists): where its file system is measured."""
    probe = Path(path).absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def _no_inodes_left(path: Path) -> bool:
    try:
        st = os.statvfs(_existing(path))
    except (OSError, AttributeError):  # no statvfs (Windows), or the path went away
        return False
    return st.f_files > 0 and st.f_favail == 0


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free to this user on the file system holding ``path`` (its nearest existing parent)."""
    return shutil.disk_usage(_existing(path)).free


def _free_or_none(path: str | os.PathLike) -> int | None:
    try:
        return free_bytes(path)
    except OSError:
        return None


def ensure_free_space(path: str | os.PathLike, need_bytes: int, what: str = "") -> int:
    """Raise `NoSpaceError` unless the file system holding ``path`` has ``need_bytes`` free; return the bytes free.

    Call it before work whose output would be lost if it could not be written (a model after hours of training).

    Args:
        path: the file or folder to be written (it need not exist yet).
        need_bytes: the bytes the output needs.
        what: what the output is, for the message (``"model"``).
    """
    free = free_bytes(path)
    if free < need_bytes:
        raise NoSpaceError(path, needed=int(need_bytes), free=free, what=what)
    return free


def _as_no_space(
    err: BaseException, path: Path, tmp: Path, needed: int | None = None, native: bool = False
) -> BaseException:
    """``err`` as a `NoSpaceError` naming ``path`` when it is, or arose from, ENOSPC/EDQUOT, else ``err``."""
    cause = _space_error_in(err, path.parent if native else None)
    if cause is None:
        return err
    if isinstance(cause, NoSpaceError):  # a nested write's, already naming its file
        return cause
    try:
        written = tmp.stat().st_size
    except OSError:
        written = None
    with contextlib.suppress(OSError):
        tmp.unlink()  # before measuring what is free: the partial file is not kept
    return NoSpaceError(path, needed=needed, free=_free_or_none(path.parent), code=cause.errno, written=written)


def _host() -> str:
    return socket.gethostname().replace(".", "_").replace("-", "_") or "host"


def tmp_path_for(path: str | os.PathLike) -> Path:
    """A fresh temporary name beside ``path``, in the form `clean_stale_tmp()` recognises."""
    path = Path(path)
    return path.with_name(f".{path.name}.{_host()}-{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")


def _writer_gone(tmp: Path, max_age_s: float, now: float) -> bool:
    """Whether the process that wrote ``tmp`` (named by `tmp_path_for()`) is gone."""
    parts = tmp.name[: -len(_TMP_SUFFIX)].rsplit(".", 2)
    if len(parts) != 3 or "-" not in parts[1]:
        return False  # not one of ours
    host, _, pid = parts[1].rpartition("-")
    try:
        age = now - tmp.stat().st_mtime
    except FileNotFoundError:
        return False
    if host == _host() and pid.isdigit():
        try:
            os.kill(int(pid), 0)  # this process's own pid, or another user's (PermissionError): alive
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    return age > max_age_s


def clean_stale_tmp(folder: str | os.PathLike, target: str | None = None, max_age_s: float = 86400.0) -> list[Path]:
    """Remove temporary files (and folders) that killed writers left in ``folder``.

    One is removed when its process no longer runs on this host or, made on another host (a shared file
    system), when it is older than ``max_age_s``. Files not named by `tmp_path_for()` are left alone.

    Args:
        folder: the folder to clean (a missing folder is fine).
        target: only leftovers of this file name (e.g. ``"results.json"``).
        max_age_s: age after which another host's leftover counts as stale.

    Returns:
        The paths removed.
    """
    folder = Path(folder)
    removed: list[Path] = []
    now = time.time()
    try:
        candidates = list(folder.glob(f".{target}.*{_TMP_SUFFIX}" if target else f".*{_TMP_SUFFIX}"))
    except OSError:
        return removed
    for tmp in candidates:
        if _writer_gone(tmp, max_age_s, now):
            with contextlib.suppress(FileNotFoundError):
                if tmp.is_dir() and not tmp.is_symlink():
                    shutil.rmtree(tmp)
                else:
                    tmp.unlink()
                removed.append(tmp)
    if removed:
        logger.info("removed %d temporary file(s) left by killed writers in %s", len(removed), folder)
    return removed


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike,
    mode: str = "w",
    fsync: bool = False,
    clean: bool = True,
    size: int | None = None,
    **open_kwargs: Any,
) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on a clean exit rename it onto ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was; the parent folder
    is created if needed; running out of space raises `NoSpaceError` naming ``path``.

    Args:
        path: the final file.
        mode: ``"w"`` (text) or ``"wb"`` (bytes).
        fsync: flush the file and the folder's entry to stable storage before returning (survives a power cut).
        clean: first remove leftovers of killed writers of this file (``False``: the caller cleans the folder once).
        size: the bytes the file will hold, where known, for the space missing in the error.
        open_kwargs: passed to `open()` (``encoding``, ...).

    Yields:
        The open temporary file (its permissions follow the process's umask).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    with _renamed_into_place(path, fsync, clean, size, native=False) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f


def atomic_path(
    path: str | os.PathLike, fsync: bool = False, clean: bool = True, size: int | None = None
) -> contextlib.AbstractContextManager[Path]:
    """A temporary path beside ``path`` for a writer that takes a file name; renamed onto ``path`` on a clean exit.

    `atomic_write()` for libraries that open the file themselves (``nib.save(img, name)``); a C/C++ writer's
    error counts as a full file system when less than `FULL_BELOW` bytes are left. The temporary name ends
    in ``.tmp``: a writer that picks its format from the suffix needs the format passed. Args as `atomic_write()`.

    Raises:
        FileNotFoundError: the writer returned without writing the temporary path.
    """
    return _renamed_into_place(path, fsync, clean, size, native=True)


@contextlib.contextmanager
def _renamed_into_place(
    path: str | os.PathLike, fsync: bool, clean: bool, size: int | None, native: bool
) -> Iterator[Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if clean:
        clean_stale_tmp(path.parent, target=path.name)
    tmp = tmp_path_for(path)
    try:
        yield tmp
        if not tmp.is_file():
            raise FileNotFoundError(f"{path}: the writer wrote nothing under the temporary name {tmp.name}")
        if fsync:
            _fsync(tmp)
        os.replace(tmp, path)
        if fsync:
            with contextlib.suppress(OSError):  # not every file system lets a folder be opened and synced
                _fsync(path.parent)
    except Exception as err:  # an OSError, or a writer's own error raised over one (torch.save's "unexpected pos")
        converted = _as_no_space(err, path, tmp, size, native=native)
        _remove_tmp(tmp)
        if converted is err:
            raise
        raise converted from err
    except BaseException:
        _remove_tmp(tmp)
        raise


def _remove_tmp(tmp: Path) -> None:
    """Remove ``tmp`` and what a writer made beside it from its name (kineto writes ``<name>.tmp`` first)."""
    with contextlib.suppress(OSError):
        for leftover in tmp.parent.glob(glob_escape(tmp.name) + "*"):
            leftover.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(data: bytes, path: str | os.PathLike, fsync: bool = False, clean: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically; returns ``path``. A full file system's error says how much is missing."""
    with atomic_write(path, "wb", fsync=fsync, clean=clean, size=len(data)) as f:
        f.write(data)
    return Path(path)


def write_text(text: str, path: str | os.PathLike, fsync: bool = False) -> Path:
    """Write ``text`` to ``path`` atomically (UTF-8); returns ``path``."""
    return write_bytes(text.encode("utf-8"), path, fsync=fsync)


def write_json(
    obj: Any, path: str | os.PathLike, indent: int | None = 2, fsync: bool = False, **dump_kwargs: Any
) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically; returns ``path``."""
    return write_text(json.dumps(obj, indent=indent, **dump_kwargs), path, fsync=fsync)
