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

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec.asyn import AsyncFileSystem

from monai_fast.apps.sources.remote_fetch import _fetch_all
from monai_fast.apps.sources.remote_io import (
    RemoteDataError,
    _Limits,
    _limits,
    _lookup,
    _options,
    _parallel,
    _reason,
    _Remote,
    _require_client,
    _retrying,
    _run,
    _scheme,
    _unreachable,
    is_url,
)
from monai_fast.folders import cache_root

__all__ = ["RemoteDataError", "is_url", "localize", "read_remote_text", "remote_cache_dir"]

logger = logging.getLogger("monai_fast.apps.sources.remote")

_LOCAL = ("file", "local")


def remote_cache_dir() -> Path:
    """Where `localize()` keeps its copies by default: ``<cache_root()>/remote``."""
    return cache_root() / "remote"


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


def localize(
    datalist: Sequence[dict],
    cache_dir: str | os.PathLike | None = None,
    workers: int = 8,
    progress: bool = True,
    storage_options: dict | None = None,
    connect_timeout: float = 10.0,
    read_timeout: float = 30.0,
    retries: int = 3,
    on_offline: Callable[[str], object] = logger.warning,
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
        on_offline: called with the one sentence saying the list is served from local copies,
            when the server cannot be reached and every URL has one (a caller that reads several
            lists collects it to log once).

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
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    limits = _limits(connect_timeout, read_timeout, retries)
    found: list[tuple[str, str]] = []
    _walk(list(datalist), "", found)
    local = {u: fsspec.core.strip_protocol(u) for _, u in found if _scheme(u) in _LOCAL}
    found = [(w, u) for w, u in found if u not in local]
    if not found:
        return _substitute(list(datalist), local)
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
    if offline:
        url, (_, err) = next(iter(offline.items()))
        hosts = sorted({f"{_scheme(u)}://{urlsplit(u).netloc}" for u in offline})
        on_offline(
            f"working offline: cannot reach {', '.join(hosts)} ({_reason(err)}); using the local "
            f"copies in {folder} of {len(offline)} remote file(s) as last fetched, which may be out of date"
        )
    return _substitute(list(datalist), local)


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
