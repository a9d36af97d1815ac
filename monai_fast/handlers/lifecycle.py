"""One attach discipline for every monai-fast handler (`EngineHandler`), and run-end hooks that always fire.

The rules are in docs/handlers.md.
"""

from __future__ import annotations

import logging
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from ignite.engine import Engine, Events
from ignite.engine.events import RemovableEventHandle
from monai.engines.utils import IterationEvents

__all__ = ["EngineHandler", "callbacks_on", "handlers_on", "is_running", "on_run_end", "wrap_callback"]

_RUN_END = "_monai_fast_run_end"
_REGISTRY = "_monai_fast_handlers"
logger = logging.getLogger("monai_fast.handlers")


class _RunEndHandle:
    """Removes one `on_run_end()` hook again."""

    def __init__(self, engine: Engine, entry: tuple) -> None:
        self.engine, self.entry = engine, entry

    def remove(self) -> None:
        hooks = getattr(self.engine, _RUN_END, [])
        if self.entry in hooks:
            hooks.remove(self.entry)


def _run_all(engine: Engine) -> None:
    hooks = list(getattr(engine, _RUN_END, []))
    for fn, _ in [h for h in hooks if not h[1]] + [h for h in hooks if h[1]]:
        try:
            fn(engine)
        except Exception:  # one failing cleanup must not stop the others, nor hide the run's error
            logger.exception("cleanup %r failed", fn)


def _on_exception(engine: Engine, e: BaseException) -> None:
    _run_all(engine)
    raise e


def on_run_end(engine: Engine, fn: Callable[[Engine], None], last: bool = False, once: bool = False) -> _RunEndHandle:
    """Call ``fn(engine)`` when each run of ``engine`` ends: completed, terminated, or raised (before it propagates).

    ``fn`` may run twice for one run (``TERMINATE`` then ``COMPLETED``): make it idempotent. Hooks with
    ``last=True`` run after all others; with ``once=True`` only at the end of the current run. Returns a handle
    whose ``remove()`` unregisters ``fn``.
    """
    if once:
        inner = fn

        def fn(e: Engine) -> None:
            handle.remove()
            inner(e)

    hooks = getattr(engine, _RUN_END, None)
    if hooks is None:
        hooks = []
        setattr(engine, _RUN_END, hooks)
        engine.add_event_handler(Events.COMPLETED, _run_all)
        engine.add_event_handler(Events.TERMINATE, _run_all)
        engine.add_event_handler(Events.EXCEPTION_RAISED, _on_exception)
        # first among exception handlers, so a handler that re-raises before us cannot skip cleanup
        _move_last_to_front(engine, Events.EXCEPTION_RAISED)
    entry = (fn, last)
    hooks.append(entry)
    handle = _RunEndHandle(engine, entry)
    return handle


def _move_last_to_front(engine: Engine, event: Any) -> None:
    """Make the handler added last for ``event`` run first (ignite has no public way)."""
    handlers = engine._event_handlers[event]
    handlers.insert(0, handlers.pop())


def callbacks_on(engine: Engine, event: Any) -> list[Any]:
    """The callables registered on ``engine`` for ``event``, in order (a copy; ignite has no public list)."""
    return [entry[0] for entry in engine._event_handlers.get(event, [])]


# MONAI registers a workflow's post-processing as a closure of this Workflow method, on MODEL_COMPLETED
POSTPROCESSING = "_register_postprocessing.<locals>._run_postprocessing"


def posttrans_of(fn: Callable) -> Any | None:
    """The transform in a MONAI ``_run_postprocessing`` closure's ``posttrans`` cell (through our wrappers)."""
    parent = getattr(fn, "_parent", None)
    fn = parent() if parent is not None else fn
    if not getattr(fn, "__qualname__", "").endswith(POSTPROCESSING):
        return None
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    cell = cells.get("posttrans")
    return cell.cell_contents if cell is not None else None


def postprocessing_of(engine: Engine) -> Any | None:
    """The post-processing transform of a MONAI workflow (``postprocessing=``), else ``None``."""
    found = (posttrans_of(fn) for fn in callbacks_on(engine, IterationEvents.MODEL_COMPLETED))
    return next((t for t in found if t is not None), None)


def unwrap_inferer(engine: Engine, ours: Callable[[Any], bool]) -> None:
    """Unlink the wrappers ``ours`` matches from ``engine.inferer``'s chain of wrappers (each holds the next in
    ``inner``)."""
    while ours(getattr(engine, "inferer", None)):
        engine.inferer = engine.inferer.inner
    outer = getattr(engine, "inferer", None)
    while "inner" in getattr(outer, "__dict__", {}):
        if ours(outer.inner):
            outer.inner = outer.inner.inner
        else:
            outer = outer.inner


class _WrapHandle:
    """Puts a callable that `wrap_callback()` wrapped back in its place."""

    def __init__(self, engine: Engine, event: Any, original: Callable, wrapper: Callable) -> None:
        self.engine, self.event, self.original, self.wrapper = engine, event, original, wrapper

    def remove(self) -> None:
        handlers = self.engine._event_handlers.get(self.event, [])
        for i, (fn, args, kwargs) in enumerate(handlers):
            if fn is self.wrapper:  # gone when the user removed it meanwhile: nothing to put back
                handlers[i] = (self.original, args, kwargs)
                return


def wrap_callback(engine: Engine, event: Any, fn: Callable, wrapper: Callable) -> _WrapHandle | None:
    """Run ``wrapper`` (which gets ``fn``'s arguments and calls ``fn``) in ``fn``'s place for ``event``.

    ``has_event_handler(fn)`` and ``remove_event_handler(fn, event)`` keep working. Returns a handle whose
    ``remove()`` puts ``fn`` back, or ``None`` when ``fn`` is not registered for ``event``.
    """
    handlers = engine._event_handlers.get(event, [])
    for i, (registered, args, kwargs) in enumerate(handlers):
        if registered is fn or registered == fn:
            parent = getattr(registered, "_parent", None)
            wrapper._parent = parent if parent is not None else weakref.ref(registered)  # type: ignore[attr-defined]
            handlers[i] = (wrapper, args, kwargs)
            return _WrapHandle(engine, event, registered, wrapper)
    return None


def is_running(engine: Engine) -> bool:
    """Whether ``engine`` is inside ``run()`` (also paused by ``interrupt()``), from ignite's ``last_event_name``."""
    return engine.last_event_name not in (None, Events.COMPLETED, Events.TERMINATE, Events.EXCEPTION_RAISED)


def handlers_on(engine: Engine) -> dict[type, EngineHandler]:
    """The monai-fast handlers attached to ``engine``, by class (a copy)."""
    return dict(getattr(engine, _REGISTRY, {}))


class EngineHandler(ABC):
    """Base class of every monai-fast handler: register in ``_attach``, stop what was started in ``_detached``."""

    #: whether one instance may serve several engines (e.g. a trainer and its evaluator)
    multi_engine: ClassVar[bool] = False

    def __init__(self) -> None:
        self._wiring: dict[int, tuple[Engine, list[Any]]] = {}

    @property
    def engines(self) -> list[Engine]:
        """The engines this handler is attached to, in attach order."""
        return [engine for engine, _ in self._wiring.values()]

    @property
    def engine(self) -> Engine | None:
        """The first engine this handler is attached to, or ``None``."""
        return next(iter(self._wiring.values()))[0] if self._wiring else None

    def is_attached(self, engine: Engine | None = None) -> bool:
        """Whether attached to ``engine`` (to any engine when ``None``)."""
        return bool(self._wiring) if engine is None else id(engine) in self._wiring

    def attach(self, engine: Engine) -> None:
        """Wire this handler into ``engine``, replacing another instance of the same class there.

        Raises:
            RuntimeError: already attached to ``engine``, or to another one and not ``multi_engine``.
        """
        name = type(self).__name__
        if self.is_attached(engine):
            raise RuntimeError(f"this {name} is already attached to this engine")
        if self._wiring and not self.multi_engine:
            raise RuntimeError(f"this {name} is already attached to another engine; make one {name} per engine")
        registry: dict[type, EngineHandler] = getattr(engine, _REGISTRY, None) or {}
        setattr(engine, _REGISTRY, registry)
        old = registry.get(type(self))
        if old is not None and old is not self:
            logger.info("%s: a new instance replaces the one already attached to this engine", name)
            old.detach(engine)
        self._wiring[id(engine)] = (engine, [])
        registry[type(self)] = self
        try:
            self._attach(engine)
        except BaseException:
            self.detach(engine)
            raise

    def detach(self, engine: Engine) -> None:
        """Remove every callback this handler registered on ``engine`` and stop what it started."""
        entry = self._wiring.pop(id(engine), None)
        if entry is None:
            return
        for handle in entry[1]:
            handle.remove()
        registry = getattr(engine, _REGISTRY, {})
        if registry.get(type(self)) is self:
            del registry[type(self)]
        self._detached(engine)

    def on(
        self,
        engine: Engine,
        event: Any,
        fn: Callable,
        *args: Any,
        owner: Engine | None = None,
        first: bool = False,
        **kwargs: Any,
    ) -> RemovableEventHandle:
        """``engine.add_event_handler(event, fn, *args, **kwargs)``, remembered for `detach()`.

        Args:
            owner: the engine this handler was attached to, when ``engine`` is another one.
            first: run before the handlers already registered for ``event``.
        """
        handle = engine.add_event_handler(event, fn, *args, **kwargs)
        if first:
            _move_last_to_front(engine, event)
        self._wiring[id(owner if owner is not None else engine)][1].append(handle)
        return handle

    def wrap(self, engine: Engine, event: Any, fn: Callable, wrapper: Callable) -> bool:
        """`wrap_callback()`, undone by `detach()`; whether ``fn`` was found and wrapped."""
        handle = wrap_callback(engine, event, fn, wrapper)
        if handle is not None:
            self._wiring[id(engine)][1].append(handle)
        return handle is not None

    def on_run_end(self, engine: Engine, fn: Callable[[Engine], None], last: bool = False) -> None:
        """`on_run_end()`, remembered for `detach()`."""
        self._wiring[id(engine)][1].append(on_run_end(engine, fn, last=last))

    @abstractmethod
    def _attach(self, engine: Engine) -> None:
        """Register this handler's callbacks on ``engine`` (with `on()` / `on_run_end()`)."""

    def _detached(self, engine: Engine) -> None:  # noqa: B027 (an optional hook)
        """Stop threads, close files: called once the handler is off ``engine``."""
