"""Fingerprints of transform chains: what a cached result depends on, as a stable hash.

A callable that cannot be read is listed in `Fingerprint.untrusted`, and the disk cache does not
reuse its entries; what is read: docs/data.md.
"""

from __future__ import annotations

import functools
import hashlib
import os
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from monai.data.utils import pickle_hashing

__all__ = ["Fingerprint", "ItemKeys", "transform_fingerprint"]

_MAX_DEPTH = 12


@dataclass
class Fingerprint:
    """A transform chain's hash and what could not be looked into."""

    digest: str
    untrusted: list[str] = field(default_factory=list)


class _Walker:
    def __init__(self) -> None:
        self.untrusted: list[str] = []
        self._active: set[int] = set()  # objects on the current path: cycles print as a reference

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
            items = (
                sorted(self.fp(x, d) for x in obj)
                if isinstance(obj, (set, frozenset))
                else [self.fp(x, d) for x in obj]
            )
            return f"{type(obj).__name__}[" + ",".join(items) + "]"
        if isinstance(obj, dict):
            return (
                "{"
                + ",".join(f"{k!s}:{self.fp(v, d)}" for k, v in sorted(obj.items(), key=lambda kv: str(kv[0])))
                + "}"
            )
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
        if isinstance(
            obj,
            (
                types.BuiltinFunctionType,
                types.BuiltinMethodType,
                types.MethodDescriptorType,
                types.WrapperDescriptorType,
                types.MethodWrapperType,
                types.ClassMethodDescriptorType,
                np.ufunc,
            ),
        ):
            return (
                f"builtin:{getattr(obj, '__module__', '')}."
                f"{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"
            )
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
        closure = [c.cell_contents for c in fn.__closure__ or () if _cell_filled(c)]
        names = _global_names(fn.__code__)
        used = {n: fn.__globals__[n] for n in sorted(names) if n in fn.__globals__}
        return (
            f"function:{fn.__module__}.{fn.__qualname__}({self._code(fn.__code__, d)},"
            f"defaults={self.fp(fn.__defaults__, d)},kwdefaults={self.fp(fn.__kwdefaults__, d)},"
            f"closure={self.fp(closure, d)},globals={self.fp(used, d)})"
        )


def _cell_filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names


def transform_fingerprint(transforms: Sequence[Any]) -> Fingerprint:
    """A stable hash of transforms' classes, parameters and functions (not their memory addresses)."""
    walker = _Walker()
    text = walker.fp(list(transforms))
    return Fingerprint(hashlib.sha1(text.encode()).hexdigest(), sorted(set(walker.untrusted)))


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
        """The key of ``item`` (MONAI's ``pickle_hashing`` of it, each file path with its identity)."""

        def with_identity(v: Any) -> Any:
            if isinstance(v, (str, os.PathLike)) and os.path.isfile(v):
                return (str(v), self.file_identity(Path(v)))
            if isinstance(v, dict):
                return {k: with_identity(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [with_identity(x) for x in v]
            return v

        return pickle_hashing(with_identity(item))
