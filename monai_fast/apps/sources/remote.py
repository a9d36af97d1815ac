"""Data lists on object storage: ``s3://`` (or any fsspec URL) entries fetched once into the local cache.

`localize()` takes a MONAI data list whose entries may be URLs (``s3://bucket/imagesTr/a.nii.gz``,
``gs://...``, ``https://...``: any scheme fsspec knows) and returns the same list with every URL
replaced by the path of a local copy, so loaders and caches work on local files. Local paths and
other values are left as they are.

- **Once.** A copy lives in ``<cache_root()>/remote/<scheme>/<hash of the URL>/<hash of the
  version>/<file name>``, where the version is the object's ETag (else its size and modification
  time). A later call asks the server for each object's version (one small request, no data) and
  downloads only what is missing or has changed.
- **Checked first.** Every URL is looked up before anything is downloaded: missing objects are one
  `FileNotFoundError` naming each URL and where the list holds it.
- **In parallel**, on daemon threads, with one progress bar (bytes) where bars are shown
  (`monai_fast.progress`) and a log line otherwise.
- **Bounded.** Every request has a time limit: connecting within ``connect_timeout``, and, while a
  body streams, at least 64 KiB every ``read_timeout`` seconds, so a server that stops sending, or
  trickles, is a stall rather than a wait without end. A stalled or dropped transfer is tried
  ``retries`` more times, then it is one `RemoteDataError` naming the URL, what stalled and
  how many bytes had arrived. For S3 the same limits go to botocore (``config_kwargs``), for
  lookups too; on filesystems that fsspec runs asynchronously (S3, GCS, Azure, HTTP) each attempt
  is also cancelled at its deadline.
- **Never half a file.** Each download streams into a temporary file beside its target, is
  fsynced and renamed into place (`monai_fast.files.atomic_write()`) only when complete and of
  the announced size. A failed download stops the others, and no file appears at a final path.
- **Ctrl-C ends it at once.** The download threads are daemons that stop within a fraction of a
  second of an interrupt, whose temporary files are removed before the interrupt propagates; a
  blocked network read never keeps the process alive.
- **Offline.** When the server cannot be reached (refused, unresolvable, timed out) and every URL
  of the list already has a local copy, the copies are used, with one warning saying so; when
  some have none, the error names each URL without a copy.
- **Credentials** come from the usual environment: for S3, ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` for S3-compatible servers
  (MinIO, Ceph), or ``storage_options`` (passed to fsspec, e.g. ``{"anon": True}``).
- **The client library.** ``s3://`` needs ``s3fs``, the ``s3`` extra (``pip install
  "monai-fast[s3]"``); without it, the first ``s3://`` URL is named in one
  `MissingExtraError` before anything is looked up.

Examples:
    >>> from monai_fast.apps.sources.remote import is_url, localize
    >>> is_url("s3://bucket/imagesTr/spleen_1.nii.gz"), is_url("/data/spleen_1.nii.gz")
    (True, False)
    >>> files = localize([{"image": "s3://bucket/imagesTr/spleen_1.nii.gz"}])  # doctest: +SKIP
    >>> files[0]["image"]  # doctest: +SKIP
    '/home/me/.cache/monai-fast/remote/s3/6f1e.../0b9a.../spleen_1.nii.gz'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.registry import known_implementations

from monai_fast.extras import require
from monai_fast.files import atomic_write
from monai_fast.folders import cache_root
from monai_fast.progress import progress_bar

__all__ = ["RemoteDataError", "is_url", "localize", "read_remote_text", "remote_cache_dir"]

logger = logging.getLogger("monai_fast.apps.sources.remote")

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_LOCAL = ("file", "local")
_S3 = ("s3", "s3a")
_CHUNK = 1 << 20  # bytes per write (and progress update)
_BLOCK = 16 << 20  # bytes per ranged request of a filesystem without a streaming reader
_STALL_BYTES = 64 << 10  # a transfer must bring at least this many bytes every read_timeout seconds
_POLL = 0.1  # seconds between a waiting thread's looks at the stop flag
_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


class RemoteDataError(OSError):
    """A remote file could not be looked up or fetched; the message names the URL."""


class _Stopped(Exception):
    """Another download failed, or the caller was interrupted; this one stops (its temporary file is removed)."""


class _Stall(Exception):
    """A request got no answer, or a body brought too few bytes, within its time limit.

    ``partial`` is how many bytes of the current piece had arrived when it stalled.
    """

    def __init__(self, message: str, partial: int = 0) -> None:
        super().__init__(message)
        self.partial = partial


def _reason(err: BaseException) -> str:
    """``err`` as a message: a stall says itself what happened, other errors carry their type."""
    return str(err) if isinstance(err, _Stall) else f"{type(err).__name__}: {err}"


@dataclass(frozen=True)
class _Limits:
    connect_timeout: float
    read_timeout: float
    retries: int

    @property
    def request_s(self) -> float:
        """Deadline of one small request (a lookup, the start of a download)."""
        return self.connect_timeout + self.read_timeout

    def backoff(self, attempt: int) -> float:
        """Pause before try ``attempt`` (2, 3, ...)."""
        return min(0.25 * 2 ** (attempt - 2), 5.0)


def _limits(connect_timeout: float, read_timeout: float, retries: int) -> _Limits:
    for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    return _Limits(float(connect_timeout), float(read_timeout), int(retries))


def _scheme(value: str) -> str | None:
    match = _SCHEME.match(value)
    if match is None:
        return None
    scheme = match.group(1).lower()
    return scheme if scheme in known_implementations or scheme in fsspec.available_protocols() else None


def is_url(value: Any) -> bool:
    """Whether ``value`` is a string URL whose scheme fsspec knows (``file://`` counts: it is used in place).

    Examples:
        >>> is_url("s3://b/k.nii.gz"), is_url("https://x.org/a.nii"), is_url("C:/data/a.nii"), is_url(3)
        (True, True, False, False)
    """
    return isinstance(value, str) and _scheme(value) is not None


def remote_cache_dir() -> Path:
    """Where `localize()` keeps its copies by default: ``<cache_root()>/remote``."""
    return cache_root() / "remote"


def _require_client(urls: Sequence[str]) -> None:
    """Raise `MissingExtraError` naming the first URL whose client library is missing.

    ``s3://`` needs ``s3fs`` (the ``s3`` extra); the check comes before any filesystem is made, so
    no connection is tried and fsspec's own ``ImportError`` never surfaces.
    """
    for url in urls:
        if _scheme(url) in _S3:
            require("s3fs", extra="s3", feature=f"reading {url}")
            return


def _options(url: str, storage_options: dict, limits: _Limits) -> dict:
    """fsspec options for ``url``: the user's, over the time limits the client library understands."""
    options = dict(storage_options)
    if _scheme(url) in _S3:
        # botocore's own retries would multiply ours; one attempt per try, ours counted and bounded
        config = {
            "connect_timeout": limits.connect_timeout,
            "read_timeout": limits.read_timeout,
            "retries": {"total_max_attempts": 1},
        }
        config.update(options.get("config_kwargs") or {})
        options["config_kwargs"] = config
    return options


def _connection_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError, socket.gaierror, _Stall]
    with contextlib.suppress(ImportError):
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import ReadTimeoutError

        errors += [BotoConnectionError, ReadTimeoutError]
    with contextlib.suppress(ImportError):
        from aiohttp import ClientConnectionError

        errors.append(ClientConnectionError)
    return tuple(errors)


def _unreachable(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) says the server could not be reached or answered too late."""
    errors = _connection_errors()
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, errors):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _run(fs: Any, make: Callable[[], Awaitable[Any]], timeout: float | None, stop: threading.Event | None) -> Any:
    """Run a coroutine of the async filesystem ``fs`` on its event loop, cancelled at ``timeout`` or on ``stop``.

    The calling thread waits in short steps, so a stop request (another download failed, Ctrl-C)
    cancels the request within ``_POLL`` seconds however long the network read would block.
    """

    async def bounded() -> Any:
        try:
            return await asyncio.wait_for(make(), timeout)
        except asyncio.TimeoutError as e:
            raise _Stall(f"no answer within {timeout:g} s (connect_timeout + read_timeout)") from e

    future = asyncio.run_coroutine_threadsafe(bounded(), fs.loop)
    try:
        while True:
            done, _ = concurrent.futures.wait([future], timeout=_POLL)
            if done:
                return future.result()
            if stop is not None and stop.is_set():
                raise _Stopped()
    except BaseException:
        future.cancel()  # Ctrl-C in this thread, a stop request: the request on the loop ends too
        raise


def _retrying(
    what: str, limits: _Limits, stop: threading.Event | None, call: Callable[[], Any], level: int = logging.INFO
) -> Any:
    """``call()``, tried again ``limits.retries`` times on errors other than missing, forbidden or stopped.

    Each failed try is logged at ``level``; the last one's error propagates.
    """
    for attempt in range(1, limits.retries + 2):
        try:
            return call()
        except (_Stopped, FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except Exception as e:
            if attempt > limits.retries:
                raise
            pause = limits.backoff(attempt + 1)
            logger.log(
                level,
                "%s: try %d of %d failed (%s); trying again in %.2f s",
                what,
                attempt,
                limits.retries + 1,
                _reason(e),
                pause,
            )
            if stop is not None and stop.wait(pause):
                raise _Stopped() from e
            if stop is None:
                time.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass
class _Remote:
    url: str
    fs: Any
    path: str
    size: int | None
    version: str


def _version(info: dict) -> str:
    etag = info.get("ETag") or info.get("etag") or info.get("e_tag")
    if etag:
        return "etag:" + str(etag).strip('"')
    mtime = next((info[k] for k in _MTIME_KEYS if info.get(k) is not None), None)
    return f"size:{info.get('size')}-mtime:{mtime}"


def _lookup(url: str, storage_options: dict, limits: _Limits) -> _Remote:
    fs, path = fsspec.core.url_to_fs(url, **_options(url, storage_options, limits))
    fs.invalidate_cache(path)  # a listing cached by fsspec must not hide a changed object
    if isinstance(fs, AsyncFileSystem):
        info = _retrying(
            f"looking up {url}", limits, None, lambda: _run(fs, lambda: fs._info(path), limits.request_s, None)
        )
    else:
        info = _retrying(f"looking up {url}", limits, None, lambda: fs.info(path))
    if info.get("type") == "directory":
        raise RemoteDataError(f"{url} is a folder, not a file")
    size = info.get("size")
    return _Remote(url, fs, path, int(size) if size is not None else None, _version(info))


def _url_dir(url: str, cache_dir: Path) -> Path:
    return cache_dir / (_scheme(url) or "url") / hashlib.sha256(url.encode()).hexdigest()[:20]


def _file_name(url: str) -> str:
    return PurePosixPath(urlsplit(url).path).name or "data"


def _local_path(remote: _Remote, cache_dir: Path) -> Path:
    version = hashlib.sha256(remote.version.encode()).hexdigest()[:12]
    return _url_dir(remote.url, cache_dir) / version / _file_name(remote.url)


def _cached_copy(url: str, cache_dir: Path) -> Path | None:
    """The newest complete local copy of ``url`` (any version), or ``None``.

    Only complete files carry the final name: a download in progress has a temporary name.
    """
    name = _file_name(url)
    try:
        copies = [p for p in _url_dir(url, cache_dir).glob(f"*/{name}") if p.is_file()]
    except OSError:
        return None
    return max(copies, key=lambda p: p.stat().st_mtime_ns, default=None)


def _parallel(
    fn: Callable[[str], Any], items: Sequence[str], workers: int, stop: threading.Event | None = None
) -> dict:
    """``{item: fn(item)}`` on daemon threads; every exception comes back as the value (none is lost).

    The threads are daemons and the caller waits in short, interruptible steps: Ctrl-C reaches the
    caller at once (it sets ``stop``), and a thread still blocked in a network read never keeps
    the process alive.
    """
    items = list(items)
    results: dict = {}
    if not items:
        return results
    lock, finished = threading.Lock(), threading.Event()
    pending = list(reversed(items))

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                item = pending.pop()
            try:
                value = fn(item)
            except BaseException as e:  # handed to the caller, which raises it
                value = e
                if stop is not None and not isinstance(e, _Stopped):
                    stop.set()  # the other downloads stop at once
            with lock:
                results[item] = value
                if len(results) == len(items):
                    finished.set()

    try:  # the threads start inside: a Ctrl-C between two starts stops those already running
        for i in range(max(1, min(workers, len(items)))):
            threading.Thread(target=work, name=f"monai-fast-fetch-{i}", daemon=True).start()
        while not finished.wait(_POLL):
            pass
    except BaseException:  # Ctrl-C while starting or waiting: the workers stop too
        if stop is not None:
            stop.set()
        raise
    return results


def _walk(value: Any, where: str, found: list[tuple[str, str]]) -> None:
    if is_url(value):
        found.append((where, value))
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk(v, f"{where}[{k!r}]", found)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _walk(v, f"{where}[{i}]", found)


def _substitute(value: Any, local: dict[str, str]) -> Any:
    if isinstance(value, str):
        return local.get(value, value)
    if isinstance(value, dict):
        return {k: _substitute(v, local) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_substitute(v, local) for v in value)
    return value


def _listed(urls: Sequence[str], found: list[tuple[str, str]]) -> str:
    where: dict[str, str] = {}
    for w, u in found:
        where.setdefault(u, w)
    more = f" and {len(urls) - 10} more" if len(urls) > 10 else ""
    return ", ".join(f"{u} (at {where[u]})" for u in urls[:10]) + more


def _lookup_all(
    found: list[tuple[str, str]], workers: int, storage_options: dict, limits: _Limits, cache_dir: Path
) -> tuple[dict[str, _Remote], dict[str, tuple[Path, BaseException]]]:
    """Each URL's remote object; and, for URLs whose server cannot be reached, their cached copy and why."""
    urls = list(dict.fromkeys(url for _, url in found))
    down: dict[str, BaseException] = {}  # host -> the error that showed it unreachable
    lock = threading.Lock()

    def look(url: str) -> _Remote:
        host = f"{_scheme(url)}://{urlsplit(url).netloc}"
        with lock:
            known = down.get(host)
        if known is not None:  # one host down is found once, not once per file
            raise known
        try:
            return _lookup(url, storage_options, limits)
        except Exception as e:
            if _unreachable(e):
                with lock:
                    down.setdefault(host, e)
            raise

    results = _parallel(look, urls, workers)
    missing = [u for u in urls if isinstance(results[u], FileNotFoundError)]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} remote file(s) in the data list do not exist: {_listed(missing, found)}"
        )
    offline: dict[str, tuple[Path, BaseException]] = {}
    uncached: list[str] = []
    for u in urls:
        e = results[u]
        if isinstance(e, BaseException) and _unreachable(e):
            copy = _cached_copy(u, cache_dir)
            if copy is None:
                uncached.append(u)
            else:
                offline[u] = (copy, e)
    if uncached:
        first = results[uncached[0]]
        raise RemoteDataError(
            f"cannot reach the server ({_reason(first)}) and {len(uncached)} remote file(s) have no "
            f"local copy in {cache_dir} to work offline from: {_listed(uncached, found)}"
        ) from first
    for u in urls:
        e = results[u]
        if isinstance(e, BaseException) and u not in offline:
            raise RemoteDataError(f"cannot look up {u}: {_reason(e)}") from e
    return {u: r for u, r in results.items() if u not in offline}, offline


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


def _localize(
    datalist: Sequence[dict],
    cache_dir: str | os.PathLike | None = None,
    workers: int = 8,
    progress: bool = True,
    storage_options: dict | None = None,
    connect_timeout: float = 10.0,
    read_timeout: float = 30.0,
    retries: int = 3,
) -> tuple[list[dict], str | None]:
    """`localize()`, and, when it worked offline, the sentence saying so (the caller logs it once)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    limits = _limits(connect_timeout, read_timeout, retries)
    found: list[tuple[str, str]] = []
    _walk(list(datalist), "", found)
    local = {u: fsspec.core.strip_protocol(u) for _, u in found if _scheme(u) in _LOCAL}
    found = [(w, u) for w, u in found if u not in local]
    if not found:
        return _substitute(list(datalist), local), None
    _require_client([u for _, u in found])
    start = time.perf_counter()
    folder = Path(cache_dir) if cache_dir is not None else remote_cache_dir()
    remotes, offline = _lookup_all(found, workers, dict(storage_options or {}), limits, folder)
    todo = {}
    for url, remote in remotes.items():
        dest = _local_path(remote, folder)
        local[url] = str(dest)
        if not (dest.is_file() and (remote.size is None or dest.stat().st_size == remote.size)):
            todo[url] = (remote, dest)
    for url, (copy, _) in offline.items():
        local[url] = str(copy)
    if todo:
        mib = sum(r.size or 0 for r, _ in todo.values()) / 2**20
        logger.info("fetching %d of %d remote files (%.1f MiB) into %s", len(todo), len(remotes), mib, folder)
        _fetch_all(todo, workers, progress, limits)
    logger.info(
        "%d remote files local in %s (%d fetched now) after %.1f s",
        len(remotes) + len(offline),
        folder,
        len(todo),
        time.perf_counter() - start,
    )
    note = None
    if offline:
        url, (_, err) = next(iter(offline.items()))
        hosts = sorted({f"{_scheme(u)}://{urlsplit(u).netloc}" for u in offline})
        note = (
            f"working offline: cannot reach {', '.join(hosts)} ({_reason(err)}); using the local "
            f"copies in {folder} of {len(offline)} remote file(s) as last fetched, which may be out of date"
        )
    return _substitute(list(datalist), local), note


def localize(
    datalist: Sequence[dict],
    cache_dir: str | os.PathLike | None = None,
    workers: int = 8,
    progress: bool = True,
    storage_options: dict | None = None,
    connect_timeout: float = 10.0,
    read_timeout: float = 30.0,
    retries: int = 3,
) -> list[dict]:
    """The data list with every URL replaced by the path of a local copy, fetched if missing or changed.

    Args:
        datalist: MONAI-style list of dicts; values may be strings, lists or nested dicts. Every
            string that `is_url()` accepts is fetched (``file://`` URLs become their path).
        cache_dir: folder of the copies; default `remote_cache_dir()`.
        workers: parallel lookups and downloads.
        progress: show a byte progress bar where bars are shown (a terminal or a notebook).
        storage_options: passed to fsspec for every URL (credentials, ``client_kwargs``...). For
            S3, its ``config_kwargs`` go over the time limits given here.
        connect_timeout: seconds to open a connection.
        read_timeout: seconds within which a request must be answered and a streaming body must
            bring at least 64 KiB; a server silent (or slower) for longer is a stall.
        retries: further tries of a lookup or download after a stall, a dropped connection or a
            short body (downloads start over into the same temporary file).

    Returns:
        A new list of new dicts; the input is not changed.

    Raises:
        FileNotFoundError: objects that do not exist, all named, before anything is downloaded.
        RemoteDataError: a lookup or download failed (no access, a stall after every try, a
            dropped connection), or the server cannot be reached and some URLs have no local
            copy; the URLs are named and no partial file is left at a final path.
        ValueError: a negative ``retries``, a time limit that is not positive, ``workers < 1``.
        MissingExtraError: an ``s3://`` URL without ``s3fs`` installed; the message names the URL
            and ``pip install "monai-fast[s3]"``, before any lookup.

    Examples:
        >>> localize([{"image": "/data/a.nii.gz", "label": "file:///data/a_seg.nii.gz"}])
        [{'image': '/data/a.nii.gz', 'label': '/data/a_seg.nii.gz'}]
    """
    files, offline = _localize(
        datalist, cache_dir, workers, progress, storage_options, connect_timeout, read_timeout, retries
    )
    if offline:
        logger.warning(offline)
    return files


def read_remote_text(
    url: str,
    storage_options: dict | None = None,
    connect_timeout: float = 10.0,
    read_timeout: float = 30.0,
    retries: int = 3,
) -> str:
    """The text of a small remote file, read directly, not cached, within the same time limits as `localize()`.

    Raises:
        FileNotFoundError: no such object (the URL is named).
        RemoteDataError: any other failure to read it.
        MissingExtraError: an ``s3://`` URL without ``s3fs`` installed (the ``s3`` extra).

    Examples:
        >>> read_remote_text("s3://bucket/Task09_Spleen/dataset.json")[:1]  # doctest: +SKIP
        '{'
    """
    limits = _limits(connect_timeout, read_timeout, retries)
    _require_client([url])
    try:
        fs, path = fsspec.core.url_to_fs(url, **_options(url, dict(storage_options or {}), limits))
        if isinstance(fs, AsyncFileSystem):
            data = _retrying(
                f"reading {url}", limits, None, lambda: _run(fs, lambda: fs._cat_file(path), limits.request_s, None)
            )
        else:
            data = _retrying(f"reading {url}", limits, None, lambda: fs.cat_file(path))
        return data.decode("utf-8")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url} not found") from e
    except Exception as e:
        raise RemoteDataError(f"cannot read {url}: {_reason(e)}") from e
