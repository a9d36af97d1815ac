"""Data lists on object storage: ``s3://`` (or any fsspec URL) entries fetched once into the local cache.

:func:`localize` takes a MONAI data list whose entries may be URLs (``s3://bucket/imagesTr/a.nii.gz``,
``gs://...``, ``https://...``: any scheme fsspec knows) and returns the same list with every URL
replaced by the path of a local copy, so loaders and caches work on local files. Local paths and
other values are left as they are.

- **Once.** A copy lives in ``<cache_root()>/remote/<scheme>/<hash of the URL>/<hash of the
  version>/<file name>``, where the version is the object's ETag (else its size and modification
  time). A later call asks the server for each object's version (one small request, no data) and
  downloads only what is missing or has changed.
- **Checked first.** Every URL is looked up before anything is downloaded: missing objects are one
  :class:`FileNotFoundError` naming each URL and where the list holds it.
- **In parallel**, on a thread pool, with one progress bar (bytes) where bars are shown
  (:mod:`monai_fast.progress`) and a log line otherwise.
- **Never half a file.** Each download streams into a temporary file beside its target, is
  fsynced and renamed into place (:func:`monai_fast.files.atomic_write`) only when complete and of
  the announced size. A dropped connection raises :class:`RemoteDataError` naming the URL, the
  other downloads stop, and no file appears at the final path.
- **Credentials** come from the usual environment: for S3, ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` / ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` for S3-compatible servers
  (MinIO, Ceph), or ``storage_options`` (passed to fsspec, e.g. ``{"anon": True}``).

Example:
    >>> from monai_fast.data.remote import is_url, localize
    >>> is_url("s3://bucket/imagesTr/spleen_1.nii.gz"), is_url("/data/spleen_1.nii.gz")
    (True, False)
    >>> files = localize([{"image": "s3://bucket/imagesTr/spleen_1.nii.gz", "label": "/data/l.nii.gz"}])  # doctest: +SKIP
    >>> files[0]["image"]  # doctest: +SKIP
    '/home/me/.cache/monai-fast/remote/s3/6f1e.../0b9a.../spleen_1.nii.gz'
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import fsspec
from fsspec.registry import known_implementations

from monai_fast.files import atomic_write, cache_root
from monai_fast.progress import progress_bar

__all__ = ["RemoteDataError", "is_url", "localize", "read_remote_text", "remote_cache_dir"]

logger = logging.getLogger("monai_fast.data.remote")

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_LOCAL = ("file", "local")
_CHUNK = 1 << 20  # bytes per write (and progress update)
_BLOCK = 16 << 20  # bytes per ranged request (s3fs would read 50 MiB ahead per download)
_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


class RemoteDataError(OSError):
    """A remote file could not be looked up or fetched; the message names the URL."""


class _Stopped(Exception):
    """Another download failed; this one stops (its temporary file is removed)."""


def _scheme(value: str) -> str | None:
    match = _SCHEME.match(value)
    if match is None:
        return None
    scheme = match.group(1).lower()
    return scheme if scheme in known_implementations or scheme in fsspec.available_protocols() else None


def is_url(value: Any) -> bool:
    """Whether ``value`` is a string URL whose scheme fsspec knows (``file://`` counts: it is used in place).

    Example:
        >>> is_url("s3://b/k.nii.gz"), is_url("https://x.org/a.nii"), is_url("C:/data/a.nii"), is_url(3)
        (True, True, False, False)
    """
    return isinstance(value, str) and _scheme(value) is not None


def remote_cache_dir() -> Path:
    """Where :func:`localize` keeps its copies by default: ``<cache_root()>/remote``."""
    return cache_root() / "remote"


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


def _lookup(url: str, storage_options: dict) -> _Remote:
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    fs.invalidate_cache(path)  # a listing cached by fsspec must not hide a changed object
    info = fs.info(path)
    if info.get("type") == "directory":
        raise RemoteDataError(f"{url} is a folder, not a file")
    size = info.get("size")
    return _Remote(url, fs, path, int(size) if size is not None else None, _version(info))


def _local_path(remote: _Remote, cache_dir: Path) -> Path:
    digest = hashlib.sha256(remote.url.encode()).hexdigest()[:20]
    version = hashlib.sha256(remote.version.encode()).hexdigest()[:12]
    name = PurePosixPath(urlsplit(remote.url).path).name or "data"
    return cache_dir / (_scheme(remote.url) or "url") / digest / version / name


def _parallel(fn: Callable[[str], Any], items: Sequence[str], workers: int, stop: threading.Event | None = None) -> dict:
    """``{item: fn(item)}`` on a thread pool; every exception comes back as the value (none is lost)."""
    results: dict = {}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items))), thread_name_prefix="monai-fast-fetch") as pool:
        futures = {pool.submit(fn, item): item for item in items}
        try:
            for future in as_completed(futures):
                try:
                    results[futures[future]] = future.result()
                except Exception as e:  # handed to the caller, which raises it
                    results[futures[future]] = e
                    if stop is not None and not isinstance(e, _Stopped):
                        stop.set()  # the other downloads stop at their next chunk
        except BaseException:  # Ctrl-C while waiting: stop the workers too, then leave
            if stop is not None:
                stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
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


def _lookup_all(found: list[tuple[str, str]], workers: int, storage_options: dict) -> dict[str, _Remote]:
    urls = list(dict.fromkeys(url for _, url in found))
    results = _parallel(lambda u: _lookup(u, storage_options), urls, workers)
    missing = [u for u in urls if isinstance(results[u], FileNotFoundError)]
    if missing:
        where = {}
        for w, u in found:
            where.setdefault(u, w)
        listed = ", ".join(f"{u} (at {where[u]})" for u in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise FileNotFoundError(f"{len(missing)} remote file(s) in the data list do not exist: {listed}{more}")
    for u in urls:
        if isinstance(results[u], BaseException):
            e = results[u]
            raise RemoteDataError(f"cannot look up {u}: {type(e).__name__}: {e}") from e
    return results


def _download(remote: _Remote, dest: Path, stop: threading.Event, advance: Callable[[int], None]) -> None:
    written = 0
    try:
        with remote.fs.open(remote.path, "rb", block_size=_BLOCK) as src, atomic_write(dest, "wb", fsync=True) as dst:
            while chunk := src.read(_CHUNK):
                if stop.is_set():
                    raise _Stopped(remote.url)
                dst.write(chunk)
                written += len(chunk)
                advance(len(chunk))
            if remote.size is not None and written != remote.size:
                raise EOFError(f"the object has {remote.size} bytes")
    except _Stopped:
        raise
    except Exception as e:
        raise RemoteDataError(
            f"fetching {remote.url} failed after {written} bytes ({type(e).__name__}: {e}); no file was left at {dest}"
        ) from e


def _fetch_all(todo: dict[str, tuple[_Remote, Path]], workers: int, progress: bool) -> None:
    total = sum(r.size or 0 for r, _ in todo.values())
    stop, lock = threading.Event(), threading.Lock()
    with progress_bar(total=total, enabled=progress, desc="fetch remote data", unit="B", unit_scale=True) as bar:

        def advance(n: int) -> None:
            with lock:
                bar.update(n)

        results = _parallel(lambda u: _download(*todo[u], stop, advance), list(todo), workers, stop)
    failed = [u for u in todo if isinstance(results[u], BaseException) and not isinstance(results[u], _Stopped)]
    if len(failed) == 1:
        raise results[failed[0]]
    if failed:
        first = results[failed[0]]
        raise RemoteDataError(f"{first} ({len(failed) - 1} other download(s) failed too: {', '.join(failed[1:4])})") from first


def localize(
    datalist: Sequence[dict],
    cache_dir: str | os.PathLike | None = None,
    workers: int = 8,
    progress: bool = True,
    storage_options: dict | None = None,
) -> list[dict]:
    """The data list with every URL replaced by the path of a local copy, fetched if missing or changed.

    Args:
        datalist: MONAI-style list of dicts; values may be strings, lists or nested dicts. Every
            string that :func:`is_url` accepts is fetched (``file://`` URLs become their path).
        cache_dir: folder of the copies; default :func:`remote_cache_dir`.
        workers: parallel lookups and downloads.
        progress: show a byte progress bar where bars are shown (a terminal or a notebook).
        storage_options: passed to fsspec for every URL (credentials, ``client_kwargs``...).

    Returns:
        A new list of new dicts; the input is not changed.

    Raises:
        FileNotFoundError: objects that do not exist, all named, before anything is downloaded.
        RemoteDataError: a lookup or download failed (no access, a dropped connection); the URL is
            named and no partial file is left at the final path.

    Example:
        >>> localize([{"image": "/data/a.nii.gz", "label": "file:///data/a_seg.nii.gz"}])
        [{'image': '/data/a.nii.gz', 'label': '/data/a_seg.nii.gz'}]
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    found: list[tuple[str, str]] = []
    _walk(list(datalist), "", found)
    local = {u: fsspec.core.strip_protocol(u) for _, u in found if _scheme(u) in _LOCAL}
    found = [(w, u) for w, u in found if u not in local]
    if not found:
        return _substitute(list(datalist), local)
    start = time.perf_counter()
    folder = Path(cache_dir) if cache_dir is not None else remote_cache_dir()
    remotes = _lookup_all(found, workers, dict(storage_options or {}))
    todo = {}
    for url, remote in remotes.items():
        dest = _local_path(remote, folder)
        local[url] = str(dest)
        if not (dest.is_file() and (remote.size is None or dest.stat().st_size == remote.size)):
            todo[url] = (remote, dest)
    if todo:
        mib = sum(r.size or 0 for r, _ in todo.values()) / 2**20
        logger.info("fetching %d of %d remote files (%.1f MiB) into %s", len(todo), len(remotes), mib, folder)
        _fetch_all(todo, workers, progress)
    logger.info("%d remote files local in %s (%d fetched now) after %.1f s", len(remotes), folder, len(todo),
                time.perf_counter() - start)
    return _substitute(list(datalist), local)


def read_remote_text(url: str, storage_options: dict | None = None) -> str:
    """The text of a small remote file (a ``dataset.json``), read directly, not cached.

    Raises:
        FileNotFoundError: no such object (the URL is named).
        RemoteDataError: any other failure to read it.

    Example:
        >>> read_remote_text("s3://bucket/Task09_Spleen/dataset.json")[:1]  # doctest: +SKIP
        '{'
    """
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url} not found") from e
    except Exception as e:
        raise RemoteDataError(f"cannot read {url}: {type(e).__name__}: {e}") from e
