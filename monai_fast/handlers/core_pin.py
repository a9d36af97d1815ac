"""Keep an engine's main thread on its own core during each iteration, apart from OpenMP's pinned workers."""

from __future__ import annotations

import os
import threading
from collections.abc import Collection
from contextlib import ExitStack

from ignite.engine import Engine, Events

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.openmp import free_core, on_core

__all__ = ["MainThreadCore"]

_FREE_CORE = object()  # the default: the core the pinned workers left free


class MainThreadCore(EngineHandler):
    """During each iteration, the main thread on the core OpenMP's pinned workers left free.

    See docs/handlers.md.

    Args:
        core: the logical CPUs to compute on (default `monai_fast.openmp.free_core()`); ``None`` (also when
            no thread is pinned) registers nothing; `ValueError` when empty or outside this thread's CPUs.

    Examples:
        >>> from monai_fast.openmp import pin_openmp_workers  # doctest: +SKIP
        >>> pin_openmp_workers()  # at the process's start, before other threads  # doctest: +SKIP
        >>> MainThreadCore().attach(trainer)  # doctest: +SKIP
    """

    def __init__(self, core: Collection[int] | None | object = _FREE_CORE) -> None:
        super().__init__()
        if core is _FREE_CORE:
            core = free_core()
        if core is not None:
            core = frozenset(core)  # type: ignore[arg-type]
            allowed = os.sched_getaffinity(0)
            if not core or not core <= allowed:
                raise ValueError(
                    f"MainThreadCore: core {sorted(core)} is not within this thread's CPUs {sorted(allowed)}"
                )
        self.core: frozenset[int] | None = core  # type: ignore[assignment]
        self._held: ExitStack | None = None  # the on_core block held during an iteration

    def _attach(self, engine: Engine) -> None:
        if self.core is None:
            return
        self.on(engine, Events.ITERATION_STARTED, self._pin)
        self.on(engine, Events.ITERATION_COMPLETED, self._unpin, first=True)  # before handlers registered earlier
        self.on_run_end(engine, self._unpin)  # also when an iteration raised: the whole mask back

    def _detached(self, engine: Engine) -> None:
        self._unpin(engine)

    def _pin(self, engine: Engine) -> None:
        if threading.current_thread() is threading.main_thread() and self._held is None:
            self._held = ExitStack()
            self._held.enter_context(on_core(self.core))

    def _unpin(self, engine: Engine) -> None:
        if self._held is not None and threading.current_thread() is threading.main_thread():
            held, self._held = self._held, None
            held.close()  # on_core's exit: the whole mask back
