"""Run-end hooks that fire however a run ends: completed, terminated or raised.

Ignite has no "finally" event, and registering an ``EXCEPTION_RAISED`` handler makes ignite hand
the exception to that handler instead of raising it (``Engine._handle_exception``). A handler
that only wants to clean up (pop NVTX ranges, stop a sampling thread, close a file) must still
let the exception out, and must run even when another handler, such as MONAI's ``StatsHandler``,
re-raises first. :func:`on_run_end` installs one exception hook per engine, placed first among
the engine's exception handlers: it runs every registered cleanup, then re-raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ignite.engine import Engine, Events

__all__ = ["on_run_end"]

_ATTR = "_monai_fast_run_end"
logger = logging.getLogger("monai_fast.handlers")


def _run_all(engine: Engine) -> None:
    hooks = getattr(engine, _ATTR, [])
    for fn in [f for f, last in hooks if not last] + [f for f, last in hooks if last]:
        try:
            fn(engine)
        except Exception:  # one failing cleanup must not stop the others, nor hide the run's error
            logger.exception("cleanup %r failed", fn)


def _on_exception(engine: Engine, e: BaseException) -> None:
    _run_all(engine)
    raise e


def on_run_end(engine: Engine, fn: Callable[[Engine], None], last: bool = False) -> None:
    """Call ``fn(engine)`` when each run of ``engine`` ends: on ``COMPLETED``, on ``TERMINATE``
    (also with ``skip_completed``) and when the run raises, before the exception propagates.
    ``fn`` may be called twice for one run (``TERMINATE`` then ``COMPLETED``): make it idempotent.
    Hooks run in the order registered, those with ``last=True`` after all others (the run record
    closes last, once every handler has written its summary).
    """
    hooks = getattr(engine, _ATTR, None)
    if hooks is None:
        hooks = []
        setattr(engine, _ATTR, hooks)
        engine.add_event_handler(Events.COMPLETED, _run_all)
        engine.add_event_handler(Events.TERMINATE, _run_all)
        engine.add_event_handler(Events.EXCEPTION_RAISED, _on_exception)
        # first among exception handlers, so a handler that re-raises before us cannot skip cleanup
        handlers = engine._event_handlers[Events.EXCEPTION_RAISED]
        handlers.insert(0, handlers.pop())
    hooks.append((fn, last))
