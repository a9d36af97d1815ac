"""Downloads for `monai_fast.apps.sources.remote`: streamed, bounded, atomic, stopped together.

fsspec's ``get_file`` is not used: it bounds no body that stops or trickles and writes straight
onto the destination.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from fsspec.asyn import AsyncFileSystem

from monai_fast.apps.sources.remote_io import (
    RemoteDataError,
    _Limits,
    _parallel,
    _reason,
    _Remote,
    _retrying,
    _run,
    _Stall,
    _Stopped,
)
from monai_fast.files import atomic_write
from monai_fast.progress import progress_bar

_CHUNK = 1 << 20  # bytes per write (and progress update)
_BLOCK = 16 << 20  # bytes per ranged request of a filesystem without a streaming reader
_STALL_BYTES = 64 << 10  # a transfer must bring at least this many bytes every read_timeout seconds


async def _read_chunk(src: Any, size: int, read_timeout: float) -> bytes:
    """Up to ``size`` bytes of the stream ``src`` (fewer only at its end), at least 64 KiB per ``read_timeout`` s."""
    loop = asyncio.get_running_loop()
    parts: list[bytes] = []
    have = mark = 0
    deadline = loop.time() + read_timeout
    while have < size:
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            part = await asyncio.wait_for(src.read(size - have), left)
        except asyncio.TimeoutError as e:
            raise _Stall(
                f"fewer than {_STALL_BYTES >> 10} KiB arrived in {read_timeout:g} s (read_timeout)", have
            ) from e
        if not part:
            break
        parts.append(part)
        have += len(part)
        if have - mark >= _STALL_BYTES:
            mark, deadline = have, loop.time() + read_timeout
    return b"".join(parts)


class _Transfer:
    """One download into an open temporary file: bytes written so far, progress, stop."""

    def __init__(
        self, remote: _Remote, dst: BinaryIO, stop: threading.Event, advance: Callable[[int], None], limits: _Limits
    ) -> None:
        self.remote, self.dst, self.stop, self.advance, self.limits = remote, dst, stop, advance, limits
        self.written = 0

    def restart(self) -> None:
        self.advance(-self.written)
        self.dst.seek(0)
        self.dst.truncate()
        self.written = 0

    def write(self, chunk: bytes) -> None:
        if self.stop.is_set():
            raise _Stopped()
        self.dst.write(chunk)
        self.written += len(chunk)
        self.advance(len(chunk))

    def copy(self) -> None:
        self.restart()
        fs, path, limits = self.remote.fs, self.remote.path, self.limits
        streamed = None
        if isinstance(fs, AsyncFileSystem):
            with contextlib.suppress(NotImplementedError):
                streamed = _run(fs, lambda: fs.open_async(path, "rb"), limits.request_s, self.stop)
        if streamed is not None:
            try:
                while chunk := _run(fs, lambda: _read_chunk(streamed, _CHUNK, limits.read_timeout), None, self.stop):
                    self.write(chunk)
            except _Stall as e:
                of = f" of {self.remote.size}" if self.remote.size is not None else ""
                raise _Stall(f"stalled after {self.written + e.partial}{of} bytes: {e}") from e
            finally:
                with contextlib.suppress(Exception):  # the stream's connection goes back or is dropped
                    _run(fs, streamed.close, limits.request_s, None)
        else:  # a filesystem without a streaming reader: its own client's time limits apply
            with fs.open(path, "rb", block_size=_BLOCK) as src:
                while chunk := src.read(_CHUNK):
                    self.write(chunk)
        size = self.remote.size
        if size is not None and self.written != size:
            raise EOFError(f"the body ended after {self.written} of the object's {size} bytes")


class _Temporaries:
    """The temporary files of the downloads in progress, removed by the caller when it is interrupted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: set[str] = set()

    def add(self, path: str) -> None:
        with self._lock:
            self._paths.add(path)

    def discard(self, path: str) -> None:
        with self._lock:
            self._paths.discard(path)

    def remove_all(self) -> None:
        with self._lock:
            paths, self._paths = self._paths, set()
        for path in paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _download(
    remote: _Remote,
    dest: Path,
    stop: threading.Event,
    advance: Callable[[int], None],
    limits: _Limits,
    temps: _Temporaries,
) -> None:
    """Fetch ``remote`` into ``dest``, atomically, tried ``limits.retries`` more times after a failure."""
    if stop.is_set():
        raise _Stopped()
    transfer: _Transfer | None = None
    tries = limits.retries + 1
    try:
        with atomic_write(dest, "wb", fsync=True, size=remote.size) as dst:
            temps.add(dst.name)
            transfer = _Transfer(remote, dst, stop, advance, limits)
            _retrying(f"fetching {remote.url}", limits, stop, transfer.copy, logging.WARNING)
    except _Stopped:
        raise
    except Exception as e:
        raise RemoteDataError(
            f"fetching {remote.url} failed after {tries} tr{'y' if tries == 1 else 'ies'} ({_reason(e)}); "
            f"no file was left at {dest}"
        ) from e
    finally:
        if transfer is not None:
            temps.discard(transfer.dst.name)


def _fetch_all(todo: dict[str, tuple[_Remote, Path]], workers: int, progress: bool, limits: _Limits) -> None:
    total = sum(r.size or 0 for r, _ in todo.values())
    stop, lock = threading.Event(), threading.Lock()
    temps = _Temporaries()
    with progress_bar(total=total, enabled=progress, desc="fetch remote data", unit="B", unit_scale=True) as bar:

        def advance(n: int) -> None:
            with lock:
                bar.update(n)

        try:
            results = _parallel(lambda u: _download(*todo[u], stop, advance, limits, temps), list(todo), workers, stop)
        except BaseException:  # Ctrl-C: the workers are stopping; their temporary files are removed first
            temps.remove_all()
            raise
    failed = [u for u in todo if isinstance(results[u], BaseException) and not isinstance(results[u], _Stopped)]
    if len(failed) == 1:
        raise results[failed[0]]
    if failed:
        first = results[failed[0]]
        others = ", ".join(failed[1:4])
        raise RemoteDataError(f"{first} ({len(failed) - 1} other download(s) failed too: {others})") from first
