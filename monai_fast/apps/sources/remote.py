"""Data lists on object storage: ``s3://`` (or any fsspec URL) entries fetched once into the local cache.

Copies are kept by URL and object version; with the server unreachable the cached copies serve (docs/sagemaker-s3.md).
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
    _request,
    _require_client,
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
    """The newest complete local copy of ``url`` (any version; a download in progress has a temporary name)."""
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
    where = {u: w for w, u in reversed(found)}  # where each URL is listed first
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
    failed = {u: results[u] for u in urls if isinstance(results[u], BaseException)}
    cut_off = {u: e for u, e in failed.items() if _unreachable(e)}
    offline = {u: (copy, e) for u, e in cut_off.items() if (copy := _cached_copy(u, cache_dir)) is not None}
    uncached = [u for u in cut_off if u not in offline]
    if uncached:
        first = results[uncached[0]]
        raise RemoteDataError(
            f"cannot reach the server ({_reason(first)}) and {len(uncached)} remote file(s) have no "
            f"local copy in {cache_dir} to work offline from: {_listed(uncached, found)}"
        ) from first
    for u, e in failed.items():
        if u not in offline:
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
    """A new data list with every URL replaced by the path of a local copy, fetched if missing or changed.

    Args:
        datalist: MONAI-style list of dicts; every string `is_url()` accepts is fetched (``file://``: its path).
        cache_dir, workers: folder of the copies (default `remote_cache_dir()`); parallel lookups and downloads.
        progress: a byte progress bar where bars are shown.
        storage_options: passed to fsspec for every URL (for S3 its ``config_kwargs`` win over the limits).
        connect_timeout, read_timeout, retries: seconds to connect; seconds within which a request is answered
            and a body brings 64 KiB; further tries after a stall, a dropped connection or a short body.
        on_offline: called with the sentence saying the list is served from local copies.

    Raises:
        FileNotFoundError: missing objects, all named, before anything is downloaded.
        RemoteDataError: a failed lookup or download (no partial file is left), or an unreachable server and
            URLs without a copy; the URLs named.
        ValueError, MissingExtraError: a bad option; an ``s3://`` URL without ``s3fs``, before any lookup.

    Examples:
        >>> files = localize([{"image": "s3://bucket/imagesTr/spleen_1.nii.gz"}])  # doctest: +SKIP
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
    local.update({url: str(copy) for url, (copy, _) in offline.items()})
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

    A missing object is a ``FileNotFoundError``, any other failure a `RemoteDataError` (both name the URL); an
    ``s3://`` URL without ``s3fs`` is a ``MissingExtraError``.
    """
    limits = _limits(connect_timeout, read_timeout, retries)
    _require_client([url])
    try:
        fs, path = fsspec.core.url_to_fs(url, **_options(url, dict(storage_options or {}), limits))
        return _request(fs, "cat_file", path, f"reading {url}", limits).decode("utf-8")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url} not found") from e
    except Exception as e:
        raise RemoteDataError(f"cannot read {url}: {_reason(e)}") from e
