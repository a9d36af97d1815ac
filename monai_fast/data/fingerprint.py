"""Fingerprints of transform chains and item keys: what a cached result depends on, as a stable hash.

A callable that cannot be read is listed in `Fingerprint.untrusted`; the disk caches do not reuse its
entries (docs/data.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import secrets
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from monai.data.utils import pickle_hashing
from monai.transforms import RandomizableTrait, Transform

__all__ = ["Fingerprint", "ItemKeys", "chain_key", "first_random", "transform_fingerprint"]

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
