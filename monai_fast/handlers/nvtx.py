"""NVTX ranges for an ignite / MONAI engine, and for transforms, to read in Nsight Systems."""

from __future__ import annotations

from typing import Any

import ignite.distributed as idist
from ignite.engine import Engine, Events
from monai.engines import Workflow
from monai.engines.utils import IterationEvents
from monai.transforms import InvertibleTransform, Randomizable, Transform

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.telemetry.nvtx import NvtxBackend, PackageNvtx

__all__ = ["COLORS", "NVTXHandler", "nvtx_range"]

COLORS = {
    "run": "purple",
    "epoch": "blue",
    "get batch": "red",
    "iteration": "yellow",
    "forward": "green",
    "loss": "orange",
    "backward": "cyan",
    "optimizer step": "magenta",
    "transform": "grey",
}


class NVTXHandler(EngineHandler):
    """Marks an engine's work with nested NVTX ranges, named with rank and role (docs/monitoring.md).

    Args:
        label: role in range names; default ``"validation"`` for MONAI evaluators, else ``"train"``.
        backend: where ranges go; default the ``nvtx`` package (no-op without a profiler).

    Examples:
        >>> NVTXHandler().attach(trainer)  # doctest: +SKIP
    """

    def __init__(self, label: str | None = None, backend: NvtxBackend | None = None) -> None:
        if label is not None and not label.strip():
            raise ValueError("label must be a non-empty string or None")
        super().__init__()
        self.label = label
        self.backend = backend if backend is not None else PackageNvtx()
        self._stacks: dict[int, list[str]] = {}
        self._names: dict[int, str] = {}
        self._with_phases: set[int] = set()

    multi_engine = True  # ranges are kept per engine

    def _attach(self, engine: Engine) -> None:
        label = self.label or ("validation" if "Evaluator" in type(engine).__name__ else "train")
        self._names[id(engine)] = f"rank{idist.get_rank()} {label}"
        self._stacks[id(engine)] = []

        def on(event: Any, fn: Any, *args: Any) -> None:
            self.on(engine, event, fn, *args)

        on(Events.STARTED, self._push, "run")
        on(Events.EPOCH_STARTED, self._push_epoch)
        on(Events.GET_BATCH_STARTED, self._push, "get batch")
        on(Events.GET_BATCH_COMPLETED, self._pop_to, "get batch")
        on(Events.ITERATION_STARTED, self._iteration_started)
        on(Events.ITERATION_COMPLETED, self._pop_to, "iteration")
        on(Events.EPOCH_COMPLETED, self._pop_to, "epoch")
        self.on_run_end(engine, self._pop_all)
        if isinstance(engine, Workflow):  # a MONAI engine: it fires IterationEvents
            self._with_phases.add(id(engine))
            trains = hasattr(engine, "optimizer")
            on(IterationEvents.FORWARD_COMPLETED, self._switch, "forward", "loss" if trains else None)
            if trains:
                on(IterationEvents.LOSS_COMPLETED, self._switch, "loss", "backward")
                on(IterationEvents.BACKWARD_COMPLETED, self._switch, "backward", "optimizer step")
                on(IterationEvents.MODEL_COMPLETED, self._switch, "optimizer step", None)

    def _detached(self, engine: Engine) -> None:
        if id(engine) in self._stacks:
            self._pop_all(engine)
            del self._stacks[id(engine)]
        self._names.pop(id(engine), None)
        self._with_phases.discard(id(engine))

    def _push(self, engine: Engine, phase: str, detail: str = "") -> None:
        self.backend.push(f"{self._names[id(engine)]}: {phase}{detail}", COLORS[phase])
        self._stacks[id(engine)].append(phase)

    def _pop_to(self, engine: Engine, phase: str) -> None:  # one stack per engine, always popped in order
        stack = self._stacks[id(engine)]
        if phase not in stack:
            return
        while stack:
            top = stack.pop()
            self.backend.pop()
            if top == phase:
                return

    def _pop_all(self, engine: Engine) -> None:
        stack = self._stacks[id(engine)]
        while stack:
            stack.pop()
            self.backend.pop()

    def _push_epoch(self, engine: Engine) -> None:
        self._push(engine, "epoch", f" {engine.state.epoch}")

    def _iteration_started(self, engine: Engine) -> None:
        self._push(engine, "iteration")
        if id(engine) in self._with_phases:
            self._push(engine, "forward")

    def _switch(self, engine: Engine, done: str, following: str | None) -> None:
        self._pop_to(engine, done)
        if following is not None:
            self._push(engine, following)


class _NVTXRange(Transform):
    """Wraps one transform in an NVTX range; see `nvtx_range()`."""

    def __init__(self, transform: Any, name: str, backend: NvtxBackend) -> None:
        self.transform = transform
        self.name = name
        self.backend = backend

    def __call__(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        self.backend.push(self.name, COLORS["transform"])
        try:
            return self.transform(data, *args, **kwargs)
        finally:
            self.backend.pop()


class _RandomNVTXRange(_NVTXRange, Randomizable):
    """The wrapper of a random transform stays random, so caches still stop in front of it."""

    def set_random_state(self, seed: int | None = None, state: Any = None) -> _RandomNVTXRange:
        self.transform.set_random_state(seed=seed, state=state)
        return self

    def randomize(self, data: Any) -> None:
        self.transform.randomize(data)


class _InvertibleNVTXRange(_NVTXRange, InvertibleTransform):
    """The wrapper of an invertible transform stays invertible: ``Compose.inverse`` undoes it."""

    def inverse(self, data: Any) -> Any:
        self.backend.push(f"{self.name} inverse", COLORS["transform"])
        try:
            return self.transform.inverse(data)
        finally:
            self.backend.pop()


class _RandomInvertibleNVTXRange(_InvertibleNVTXRange, _RandomNVTXRange):
    """Random and invertible (``RandFlipd``, ``RandRotate90d``, ...)."""


def nvtx_range(transform: Any, name: str | None = None, backend: NvtxBackend | None = None) -> Transform:
    """Wrap a transform so each call is an NVTX range (like MONAI's ``Range``, on the ``nvtx`` package).

    The wrapper stays ``Randomizable`` / ``InvertibleTransform`` where the transform is (caching, ``inverse``).

    Examples:
        >>> chain = Compose([nvtx_range(LoadImaged(keys="image")), nvtx_range(Spacingd("image", 1.5), "Spacing")])
    """
    if isinstance(transform, InvertibleTransform):
        cls = _RandomInvertibleNVTXRange if isinstance(transform, Randomizable) else _InvertibleNVTXRange
    else:
        cls = _RandomNVTXRange if isinstance(transform, Randomizable) else _NVTXRange
    return cls(transform, name or type(transform).__name__, backend if backend is not None else PackageNvtx())
