"""The argmax over classes of an engine's predictions with the class dimension innermost, where that is faster.

Why and when: docs/handlers.md.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from ignite.engine import Engine, Events
from monai.engines import Trainer
from monai.inferers import Inferer
from monai.transforms import AsDiscreted, Compose

from monai_fast.handlers.lifecycle import EngineHandler, postprocessing_of, unwrap_inferer

__all__ = ["ClassesInnermost", "argmax_gain", "classes_innermost"]

logger = logging.getLogger("monai_fast.handlers")


def classes_innermost(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``t`` with dimension ``dim`` innermost in memory: the same values, shape and type (a MetaTensor stays one)."""
    return t.movedim(dim, -1).contiguous().movedim(-1, dim)


def argmax_gain(classes: int = 2, size: int = 48, rounds: int = 3) -> tuple[float, float]:
    """Median seconds of the CPU's ``torch.argmax`` over the class dimension: as it is, and converted first.

    The random prediction comes from a generator of its own: the run's random stream does not move.
    """
    x = torch.randn(classes, size, size, size, generator=torch.Generator().manual_seed(0))

    def once(convert: bool) -> float:
        start = time.perf_counter()
        torch.argmax(classes_innermost(x) if convert else x, dim=0, keepdim=True)
        return time.perf_counter() - start

    once(False), once(True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(max(1, rounds)):
        for convert in (False, True):
            times[convert].append(once(convert))
    return statistics.median(times[False]), statistics.median(times[True])


class _ClassesInnermostInferer(Inferer):
    """Runs the engine's own inferer and returns a 5-D prediction in ``channels_last_3d``.

    Other attributes are the inner inferer's, read and set through (``evaluator.inferer.sw_batch_size``).
    """

    _OWN = ("inner", "handler", "calls")

    def __init__(self, inner: Inferer, handler: ClassesInnermost) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "handler", handler)
        object.__setattr__(self, "calls", 0)

    def __getattr__(self, name: str) -> Any:  # only called for what this object does not have itself
        if name in self._OWN:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def __call__(self, inputs: torch.Tensor, network: Callable, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        out = self.inner(inputs, network, *args, **kwargs)
        if self.handler.active and isinstance(out, torch.Tensor) and out.dim() == 5 and out.device.type == "cpu":
            return classes_innermost(out, dim=1)  # channels_last_3d: the same values; a MetaTensor stays one
        return out


class _InnermostArgmax:
    """An ``AsDiscrete`` that gets a CPU input with the classes innermost right before its argmax over them."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # only called for what this object does not have itself
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, img: Any, argmax: bool | None = None, *args: Any, **kwargs: Any) -> Any:
        wanted = self.inner.argmax if argmax is None else argmax
        dim = self.inner.kwargs.get("dim", 0)  # the dimension AsDiscrete takes its argmax over
        if wanted and isinstance(img, torch.Tensor) and img.device.type == "cpu" and img.dim() >= 3:
            if not img.movedim(dim, -1).is_contiguous():
                img = classes_innermost(img, dim)
        return self.inner(img, argmax, *args, **kwargs)


def _argmax_transforms(transform: Any) -> list[Any]:
    """The ``AsDiscreted`` transforms of a post-processing chain (nested ``Compose`` read) that take an argmax."""
    if isinstance(transform, Compose):
        return [t for inner in transform.transforms for t in _argmax_transforms(inner)]
    if isinstance(transform, AsDiscreted) and any(transform.argmax):
        return [transform]
    return []


class ClassesInnermost(EngineHandler):
    """Gives the argmax over classes of a MONAI engine's CPU predictions the classes innermost in memory.

    Each post-processing ``AsDiscreted`` that takes an argmax gets its input that way; an evaluator without
    one gets its 5-D predictions that way. ``"auto"`` times the argmax both ways and turns on where the
    innermost layout is ``min_gain`` times faster. `unused` says why it did not act. See docs/handlers.md.

    Args:
        mode: ``"auto"`` (measure) or ``True``.
        min_gain: default-layout time over innermost time needed to turn it on with ``"auto"``.

    Raises:
        ValueError: an unknown ``mode`` or ``min_gain`` <= 1.
        TypeError: (at attach) an engine that is neither a MONAI trainer nor has a MONAI ``Inferer``.

    Examples:
        >>> layout = ClassesInnermost()
        >>> layout.attach(trainer)  # doctest: +SKIP
        >>> layout.attach(evaluator)  # doctest: +SKIP
    """

    multi_engine = True  # one measurement for the trainer and its evaluator

    def __init__(self, mode: str | bool = "auto", min_gain: float = 1.2) -> None:
        if mode not in ("auto", True):
            raise ValueError(f"ClassesInnermost: mode must be 'auto' or True, got {mode!r}")
        if not min_gain > 1:
            raise ValueError(f"ClassesInnermost: min_gain must be > 1, got {min_gain!r}")
        super().__init__()
        self.mode, self.min_gain = mode, float(min_gain)
        self.active = False
        self.reason = ""
        #: post-processing transforms whose argmax gets the classes innermost, per engine (``id``)
        self.argmax_transforms: dict[int, list[str]] = {}
        #: why the layout did not act on the evaluator's step (found at its first iteration), else ``None``
        self.unused: str | None = None
        self._wrappers: dict[int, _ClassesInnermostInferer] = {}
        # id(transform) -> (the AsDiscreted, its own converter, the engines whose chain holds it)
        self._owners: dict[int, tuple[Any, Any, set[int]]] = {}

    def _decide(self, engine: Engine) -> None:
        if self.reason:  # decided at the first engine
            return
        if self.mode is True:
            self.active, self.reason = True, "requested"
        else:  # the slow kernel is the CPU's: timed there, whatever the engine's device
            plain_s, inner_s = argmax_gain()
            self.active = plain_s >= self.min_gain * inner_s
            self.reason = (
                f"argmax over classes measured {plain_s * 1e3:.1f} ms in the default layout against "
                f"{inner_s * 1e3:.1f} ms with the classes put innermost first"
            )
        device = torch.device(getattr(engine.state, "device", None) or "cpu")
        if self.active and device.type != "cpu":
            self.reason += f"; predictions stitched on {device.type} pass unchanged (only those stitched on the CPU)"

    def _attach(self, engine: Engine) -> None:
        trainer = isinstance(engine, Trainer)
        if not trainer and not isinstance(getattr(engine, "inferer", None), Inferer):
            raise TypeError("ClassesInnermost needs a MONAI trainer, or an evaluator (an engine with an inferer)")
        self._decide(engine)
        if not self.active:
            return
        found = _argmax_transforms(postprocessing_of(engine))
        for transform in found:  # a chain two engines share is wrapped once, and restored after the last
            owner = self._owners.setdefault(id(transform), (transform, transform.converter, set()))
            if not owner[2]:
                transform.converter = _InnermostArgmax(owner[1])
            owner[2].add(id(engine))
        self.argmax_transforms[id(engine)] = [type(t).__name__ for t in found]
        wrap = not trainer and not found  # a softmax before the argmax is slower on classes-innermost input
        what = ["its predictions"] if wrap else []
        what += [f"the argmax of {len(found)} post-processing AsDiscreted"] if found else []
        self.reason += f"; {'trainer' if trainer else 'evaluator'}: {' and '.join(what) or 'nothing to reorder'}"
        if wrap:
            self._wrappers[id(engine)] = wrapper = _ClassesInnermostInferer(engine.inferer, self)
            engine.inferer = wrapper
            self.on(engine, Events.ITERATION_COMPLETED(once=1), self._first_step, first=True)

    def _first_step(self, engine: Engine) -> None:
        wrapper = self._wrappers.get(id(engine))
        if wrapper is None or wrapper.calls or not self.active:
            return
        self.active = False  # wrapped only where the post-processing has no argmax: nothing else to reorder
        self.unused = (
            "the evaluator's step does not call its inferer (a step function of its own): "
            "its predictions are left as they come"
        )
        logger.warning("ClassesInnermost: turned off: %s", self.unused)

    def _detached(self, engine: Engine) -> None:
        for key, (transform, converter, engines) in list(self._owners.items()):
            engines.discard(id(engine))
            if not engines:
                transform.converter = converter
                del self._owners[key]
        self.argmax_transforms.pop(id(engine), None)
        if (wrapper := self._wrappers.pop(id(engine), None)) is not None:  # wherever it sits in a chain of wrappers
            unwrap_inferer(engine, lambda inferer: inferer is wrapper)
        if not self._wiring:  # off every engine: a later attach decides afresh
            self.active, self.reason, self.unused = False, "", None
