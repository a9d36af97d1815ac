"""The network side of `monai_fast.apps.sources.remote`: URLs, time limits, retries, lookups, worker threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.registry import known_implementations
from monai.utils import optional_import

from monai_fast.extras import require

logger = logging.getLogger("monai_fast.apps.sources.remote")

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_S3 = ("s3", "s3a")
_POLL = 0.1  # seconds between a waiting thread's looks at the stop flag
_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


class RemoteDataError(OSError):
    """A remote file could not be looked up or fetched; the message names the URL."""


class _Stopped(Exception):
    """Another download failed, or the caller was interrupted; this one stops (its temporary file is removed)."""


class _Stall(Exception):
    """No answer, or too few bytes, within the time limit; ``partial``: the bytes of the piece that had arrived."""

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
    scheme = match.group(1).lower() if match else None
    return scheme if scheme in known_implementations or scheme in fsspec.available_protocols() else None


def is_url(value: Any) -> bool:
    """Whether ``value`` is a string URL whose scheme fsspec knows (``file://`` counts: it is used in place).

    ``"s3://b/k.nii.gz"`` and ``"https://x.org/a.nii"`` are; ``"C:/data/a.nii"`` and ``3`` are not.
    """
    return isinstance(value, str) and _scheme(value) is not None


def _require_client(urls: Sequence[str]) -> None:
    """Raise `MissingExtraError` (S3: the ``s3`` extra) or `RemoteDataError` (another scheme whose fsspec client is
    not installed) naming the first URL of a scheme whose client library is missing, before any connection."""
    for scheme, url in {_scheme(u): u for u in reversed(urls)}.items():
        if scheme in _S3:
            require("s3fs", extra="s3", feature=f"reading {url}")
        elif scheme is not None:
            try:
                fsspec.get_filesystem_class(scheme)
            except ImportError as e:
                raise RemoteDataError(f"cannot read {url}: fsspec's {scheme}:// client is not installed: {e}") from None


def _options(url: str, storage_options: dict, limits: _Limits) -> dict:
    """fsspec options for ``url``: the user's, over the time limits the client library understands."""
    options = dict(storage_options)
    if _scheme(url) in _S3:
        # botocore's own retries would multiply ours; one attempt per try, ours counted and bounded
        options["config_kwargs"] = {
            "connect_timeout": limits.connect_timeout,
            "read_timeout": limits.read_timeout,
            "retries": {"total_max_attempts": 1},
            **(options.get("config_kwargs") or {}),
        }
    return options


def _connection_errors() -> tuple[type[BaseException], ...]:
    """The errors that mean the server could not be reached, the installed clients' own included."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError, asyncio.TimeoutError, socket.gaierror, _Stall]
    clients = {"botocore.exceptions": ("ConnectionError", "ReadTimeoutError"), "aiohttp": ("ClientConnectionError",)}
    for module, names in clients.items():
        found, ok = optional_import(module)
        if ok:
            errors += [getattr(found, name) for name in names]
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
    """Run a coroutine of ``fs`` on its event loop, cancelled at ``timeout`` or within ``_POLL`` s of ``stop``."""

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
    """``call()``, retried ``limits.retries`` times (each failure logged) unless missing, forbidden or stopped."""
    for attempt in range(1, limits.retries + 2):
        try:
            return call()
        except (_Stopped, FileNotFoundError, PermissionError, IsADirectoryError):
            raise
        except Exception as e:
            if attempt > limits.retries:
                raise
            pause = limits.backoff(attempt + 1)
            tries = (attempt, limits.retries + 1, _reason(e), pause)
            logger.log(level, "%s: try %d of %d failed (%s); trying again in %.2f s", what, *tries)
            if stop is None:
                time.sleep(pause)
            elif stop.wait(pause):
                raise _Stopped() from e
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass
class _Remote:
    url: str
    fs: Any
    path: str
    size: int | None
    version: str


def _request(fs: Any, method: str, path: str, what: str, limits: _Limits) -> Any:
    """``fs.<method>(path)`` (its coroutine on an async filesystem, within ``limits.request_s``), retried."""
    if isinstance(fs, AsyncFileSystem):
        call = lambda: _run(fs, lambda: getattr(fs, f"_{method}")(path), limits.request_s, None)
    else:
        call = lambda: getattr(fs, method)(path)
    return _retrying(what, limits, None, call)


def _version(info: dict) -> str:
    etag = info.get("ETag") or info.get("etag") or info.get("e_tag")
    if etag:
        return "etag:" + str(etag).strip('"')
    mtime = next((info[k] for k in _MTIME_KEYS if info.get(k) is not None), None)
    return f"size:{info.get('size')}-mtime:{mtime}"


def _lookup(url: str, storage_options: dict, limits: _Limits) -> _Remote:
    fs, path = fsspec.core.url_to_fs(url, **_options(url, storage_options, limits))
    fs.invalidate_cache(path)  # a listing cached by fsspec must not hide a changed object
    info = _request(fs, "info", path, f"looking up {url}", limits)
    if info.get("type") == "directory":
        raise RemoteDataError(f"{url} is a folder, not a file")
    size = info.get("size")
    return _Remote(url, fs, path, int(size) if size is not None else None, _version(info))


def _parallel(
    fn: Callable[[str], Any], items: Sequence[str], workers: int, stop: threading.Event | None = None
) -> dict:
    """``{item: fn(item)}`` on daemon threads; an exception comes back as the value; Ctrl-C stops the wait."""
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
