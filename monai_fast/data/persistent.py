"""A disk cache you can trust: ``PersistentDataset`` keyed on what the result depends on (docs/data.md).

The keys: each item's files by identity, and a stable hash of the cached transforms. A callable that cannot be
read is listed in `Fingerprint.untrusted`; the disk caches do not reuse its entries.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import secrets
import types
import warnings
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from monai.data import PersistentDataset
from monai.data.utils import SUPPORTED_PICKLE_MOD, pickle_hashing
from monai.transforms import RandomizableTrait, Transform
from monai.utils import convert_to_tensor, look_up_option

from monai_fast.files import NoSpaceError, atomic_write, clean_stale_tmp

__all__ = ["Fingerprint", "ItemKeys", "TrustedPersistentDataset", "chain_key", "first_random", "transform_fingerprint"]

logger = logging.getLogger("monai_fast.data")

_MAX_DEPTH = 12
#: callables known by name (their code is not Python's to read)
_BUILTINS = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
    np.ufunc,
)


@dataclass
class Fingerprint:
    """A transform chain's hash and what could not be looked into."""

    digest: str
    untrusted: list[str] = field(default_factory=list)


class _Walker:
    def __init__(self) -> None:
        self.untrusted: list[str] = []
        self._active: set[int] = set()  # objects on the current path: a cycle prints as a reference

    def fp(self, obj: Any, depth: int = 0) -> str:
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return repr(obj)
        if depth > _MAX_DEPTH or id(obj) in self._active:
            return f"<{type(obj).__qualname__}>"
        self._active.add(id(obj))
        try:
            return self._fp(obj, depth + 1)
        finally:
            self._active.discard(id(obj))

    def _fp(self, obj: Any, d: int) -> str:
        if isinstance(obj, (list, tuple, set, frozenset)):
            items = [self.fp(x, d) for x in obj]
            if isinstance(obj, (set, frozenset)):
                items.sort()
            return f"{type(obj).__name__}[" + ",".join(items) + "]"
        if isinstance(obj, dict):
            pairs = sorted(obj.items(), key=lambda kv: str(kv[0]))
            return "{" + ",".join(f"{k!s}:{self.fp(v, d)}" for k, v in pairs) + "}"
        if isinstance(obj, (np.ndarray, torch.Tensor)):
            arr = obj.detach().cpu().numpy() if isinstance(obj, torch.Tensor) else obj
            return f"array{arr.shape}{arr.dtype}:{hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest()}"
        if isinstance(obj, (np.generic, torch.dtype, np.dtype)):
            return repr(obj)
        if isinstance(obj, (os.PathLike, type, types.ModuleType)):
            return f"{type(obj).__name__}:{getattr(obj, '__name__', obj)}"
        if isinstance(obj, types.FunctionType):
            return self._function(obj, d)
        if isinstance(obj, types.MethodType):
            return f"method({self.fp(obj.__func__, d)},{self.fp(obj.__self__, d)})"
        if isinstance(obj, functools.partial):
            return f"partial({self.fp(obj.func, d)},{self.fp(obj.args, d)},{self.fp(obj.keywords, d)})"
        if isinstance(obj, _BUILTINS):
            name = getattr(obj, "__qualname__", getattr(obj, "__name__", "?"))
            return f"builtin:{getattr(obj, '__module__', '')}.{name}"
        if hasattr(obj, "__dict__"):
            state = {k: v for k, v in vars(obj).items() if not k.startswith("__")}
            return f"{type(obj).__module__}.{type(obj).__qualname__}({self.fp(state, d)})"
        if callable(obj):
            self.untrusted.append(f"{type(obj).__module__}.{type(obj).__qualname__}")
        return type(obj).__qualname__  # locks, handles: nothing that changes a result

    def _code(self, code: types.CodeType, d: int) -> str:
        consts = ",".join(self._code(c, d) if isinstance(c, types.CodeType) else self.fp(c, d) for c in code.co_consts)
        return f"code({hashlib.sha1(code.co_code).hexdigest()},{consts},{code.co_names})"

    def _function(self, fn: types.FunctionType, d: int) -> str:
        closure = []
        for cell in fn.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell raises
                closure.append(cell.cell_contents)
        used = {n: fn.__globals__[n] for n in sorted(_global_names(fn.__code__)) if n in fn.__globals__}
        return (
            f"function:{fn.__module__}.{fn.__qualname__}({self._code(fn.__code__, d)},"
            f"defaults={self.fp(fn.__defaults__, d)},kwdefaults={self.fp(fn.__kwdefaults__, d)},"
            f"closure={self.fp(closure, d)},globals={self.fp(used, d)})"
        )


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def first_random(transforms: Sequence[Any]) -> int:
    """Index of the first transform a cache cannot hold (random, or not a MONAI ``Transform``); else the length."""
    return next(
        (i for i, t in enumerate(transforms) if isinstance(t, RandomizableTrait) or not isinstance(t, Transform)),
        len(transforms),
    )


def transform_fingerprint(transforms: Sequence[Any]) -> Fingerprint:
    """A stable hash of transforms' classes, parameters and functions (not their memory addresses)."""
    walker = _Walker()
    text = walker.fp(list(transforms))
    return Fingerprint(hashlib.sha1(text.encode()).hexdigest(), sorted(set(walker.untrusted)))


def chain_key(transforms: Sequence[Any], owner: str, what: str, folder: Any) -> tuple[str, bool]:
    """The cache key part of ``transforms`` and whether it can be trusted.

    An untrusted chain gets a key no other run matches (its entries are recomputed, never served stale),
    with one warning naming ``owner``'s ``what`` in ``folder``.
    """
    fingerprint = transform_fingerprint(transforms)
    key = fingerprint.digest[:16]
    if fingerprint.untrusted:
        key += "-" + secrets.token_hex(4)
        logger.warning(
            "%s: the cached transforms hold callables whose behaviour cannot be fingerprinted (%s); their %s in %s "
            "are recomputed in each run instead of reused",
            owner,
            ", ".join(fingerprint.untrusted),
            what,
            folder,
        )
    return key, not fingerprint.untrusted


class ItemKeys:
    """Cache keys of data items that change when a file they name changes, not only its path.

    Args:
        identity: ``"stat"`` (size and modification time) or ``"content"`` (SHA-1, hashed once per file version).
    """

    def __init__(self, identity: Literal["stat", "content"] = "stat") -> None:
        if identity not in ("stat", "content"):
            raise ValueError(f"identity must be 'stat' or 'content', got {identity!r}")
        self.identity = identity
        self._content: dict[tuple, str] = {}

    def file_identity(self, path: str | os.PathLike) -> Any:
        """What of ``path`` enters the key: ``(size, mtime_ns)`` or the content's SHA-1."""
        st = os.stat(path)
        if self.identity == "stat":
            return (st.st_size, st.st_mtime_ns)
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in self._content:
            h = hashlib.sha1()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            self._content[key] = h.hexdigest()
        return self._content[key]

    def __call__(self, item: Any) -> bytes:
        """MONAI's ``pickle_hashing`` of ``item``, each file path paired with its identity."""

        def with_identity(v: Any) -> Any:
            if isinstance(v, (str, os.PathLike)) and os.path.isfile(v):
                return (str(v), self.file_identity(Path(v)))
            if isinstance(v, dict):
                return {k: with_identity(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [with_identity(x) for x in v]
            return v

        return pickle_hashing(with_identity(item))


class TrustedPersistentDataset(PersistentDataset):
    """``PersistentDataset`` keyed on file identity and transform parameters, with atomic writes.

    Damaged files are rebuilt; a full disk is named once, the remaining items then computed in memory.

    Args:
        data: items, e.g. ``{"image": path, "label": path}``.
        transform: the chain; everything before the first random transform is cached.
        cache_dir: the cache folder (created).
        identity: ``"stat"`` (size + mtime, default) or ``"content"`` (SHA-1 of the bytes).
        kwargs: passed to ``PersistentDataset`` (not ``hash_func`` / ``hash_transform``).

    Attributes:
        disk_full: the `NoSpaceError` naming the folder once it filled up (items no longer written), else ``None``.

    Examples:
        >>> ds = TrustedPersistentDataset(train_files, transforms, cache_dir="/scratch/cache")  # doctest: +SKIP
    """

    def __init__(
        self,
        data: Sequence,
        transform: Sequence[Callable] | Callable,
        cache_dir: str | os.PathLike,
        identity: Literal["stat", "content"] = "stat",
        **kwargs: Any,
    ) -> None:
        self._item_key = ItemKeys(identity)  # refuses an unknown identity
        for bad in ("hash_func", "hash_transform"):
            if bad in kwargs:
                raise ValueError(f"{bad} is set by TrustedPersistentDataset; do not pass it")
        if cache_dir is None:
            raise ValueError("cache_dir is required (use CacheDataset for an in-memory cache)")
        self.identity = identity
        self.disk_full: NoSpaceError | None = None
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(cache_dir)  # leftovers of killed writers, once per data set
        super().__init__(data=data, transform=transform, cache_dir=cache_dir, hash_func=self._item_key, **kwargs)
        flat = self.transform.flatten().transforms
        deterministic = flat[: first_random(flat)]
        self.transform_hash, self.trusted = chain_key(
            deterministic, "TrustedPersistentDataset", "cache files", cache_dir
        )
        if self.track_meta:  # files of plain tensors and of MetaTensors are not each other's
            self.transform_hash += "-meta"

    def _cachecheck(self, item_transformed: Any) -> Any:
        key = self.hash_func(item_transformed).decode("utf-8") + self.transform_hash
        hashfile = Path(self.cache_dir) / f"{key}.pt"
        if hashfile.is_file():
            try:
                return torch.load(hashfile, weights_only=self.weights_only)
            except PermissionError:
                raise
            except Exception as e:  # any damage: rebuilt, never trained on
                warnings.warn(
                    f"cache file {hashfile} is damaged ({type(e).__name__}: {e}); rebuilding it", stacklevel=2
                )
                hashfile.unlink(missing_ok=True)
        result = self._pre_transform(deepcopy(item_transformed))
        if self.disk_full is not None:
            return result
        try:
            with atomic_write(hashfile, "wb", clean=False) as f:  # the folder was cleaned once, in __init__
                self._save(result, f)
        except NoSpaceError as err:  # no file under the item's name; go on without the disk
            self._stop_writing(err, result)
        return result

    def _save(self, result: Any, f: Any) -> None:
        torch.save(
            convert_to_tensor(result, convert_numeric=False, track_meta=self.track_meta),
            f,
            pickle_module=look_up_option(self.pickle_module, SUPPORTED_PICKLE_MOD),  # as MONAI does
            pickle_protocol=self.pickle_protocol,
        )

    def _stop_writing(self, err: NoSpaceError, result: Any) -> None:
        """Stop writing to the full cache folder, with one warning naming it and the space one item misses."""
        size = io.BytesIO()
        try:
            self._save(result, size)
            needed: int | None = size.getbuffer().nbytes
        except Exception:  # noqa: BLE001 - the size is for the message only
            needed = None
        finally:
            size.close()
        self.disk_full = NoSpaceError(
            self.cache_dir,
            needed=needed,
            free=err.free,
            what="disk cache folder",
            code=err.errno,
            detail="items are no longer written there (those already cached are still read) and the rest are "
            "computed in memory each time they are loaded; free space there or use another cache folder",
        )
        logger.warning("TrustedPersistentDataset: %s", self.disk_full)
