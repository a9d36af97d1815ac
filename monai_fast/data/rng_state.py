"""Capture and restore every random state a MONAI training run draws from: the global generators and
the ``.R`` of every ``Randomizable`` transform reachable from a data set."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from monai.transforms import Randomizable, Transform

from monai_fast.telemetry.cuda import cuda_rng_states, set_cuda_rng_states

__all__ = ["OwnRandomStream", "capture", "randomizables", "restore"]

_WALK = ("dataset", "transform", "transforms", "loader")
_RANDOM_PARTS = (Transform, Randomizable)


def randomizables(root: Any, _seen: set[int] | None = None) -> list[Any]:
    """Objects with a ``numpy.random.RandomState`` ``R`` reachable from ``root``, in a fixed order.

    The walk follows ``dataset``, ``transform``, ``transforms``, ``loader`` and nested transforms (a
    cropper inside ``RandCropByPosNegLabeld``); objects sharing one ``RandomState`` appear once.
    """
    seen = set() if _seen is None else _seen
    found: list[Any] = []
    if root is None or id(root) in seen or isinstance(root, (str, bytes, int, float, torch.Tensor, np.ndarray)):
        return found
    seen.add(id(root))
    if isinstance(root, (list, tuple)):
        for item in root:
            found += randomizables(item, seen)
        return found
    rs = getattr(root, "R", None)
    if isinstance(rs, np.random.RandomState) and id(rs) not in seen:
        seen.add(id(rs))
        found.append(root)
    for name, child in getattr(root, "__dict__", {}).items():
        if (
            name in _WALK
            or isinstance(child, _RANDOM_PARTS)
            or (isinstance(child, (list, tuple)) and child and isinstance(child[0], _RANDOM_PARTS))
        ):
            found += randomizables(child, seen)
    return found


def capture(data: Any = None) -> dict:
    """The global random states, and those of the ``Randomizable`` transforms under ``data``."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda_rng_states(),
    }
    if data is not None:
        state["transforms"] = [obj.R.get_state() for obj in randomizables(data)]
    return state


def restore(state: dict, data: Any = None) -> None:
    """Put back what `capture()` took; ``data`` must hold the same transform chain.

    Raises:
        ValueError: the number of random transforms under ``data`` differs from the capture's.
    """
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    set_cuda_rng_states(state.get("cuda"))
    if data is not None and "transforms" in state:
        objs = randomizables(data)
        if len(objs) != len(state["transforms"]):
            raise ValueError(
                f"the data's transform chain has {len(objs)} random transforms, the saved state "
                f"{len(state['transforms'])}: resume with the same transforms"
            )
        for obj, s in zip(objs, state["transforms"]):
            obj.R.set_state(s)


class OwnRandomStream:
    """A run's own copy of the global random generators, swapped in while the run works (``with``).

    Runs taking turns in one process each draw exactly as they would alone. Create it just after
    the run seeded itself.

    Examples:
        >>> with OwnRandomStream():
        ...     a = torch.rand(1)
    """

    def __init__(self) -> None:
        self._state = capture()
        self._outside: dict | None = None

    def __enter__(self) -> OwnRandomStream:
        self._outside = capture()
        restore(self._state)
        return self

    def __exit__(self, *exc: object) -> None:
        self._state = capture()
        if self._outside is not None:
            restore(self._outside)
            self._outside = None
