"""Background threads stopped before the interpreter exits, so that a stopped run ends cleanly.

A daemon thread inside torch's C++ code at interpreter shutdown aborts the process (exit status -6). Objects
running such threads register with `stop_at_exit()` (weakly); an ``atexit`` hook calls their ``stop_for_exit()``.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol, runtime_checkable

__all__ = ["ExitStoppable", "forget_at_exit", "stop_all_now", "stop_at_exit"]

logger = logging.getLogger("monai_fast.threads")


@runtime_checkable
class ExitStoppable(Protocol):
    """An object whose background threads can be stopped: ``stop_for_exit()`` stops and joins them (bounded)."""

    def stop_for_exit(self) -> None: ...


_LIVE: weakref.WeakSet = weakref.WeakSet()
_LOCK = threading.Lock()


def stop_at_exit(owner: ExitStoppable) -> None:
    """Have ``owner.stop_for_exit()`` called before the interpreter exits (if ``owner`` still lives then).

    Raises:
        TypeError: ``owner`` has no ``stop_for_exit()`` method.
    """
    if not isinstance(owner, ExitStoppable):
        raise TypeError(f"stop_at_exit needs an object with a stop_for_exit() method, got {type(owner).__name__}")
    with _LOCK:
        _LIVE.add(owner)


def forget_at_exit(owner: object) -> None:
    """Take ``owner`` off the exit list (its threads have stopped); no-op if it is not on it."""
    with _LOCK:
        _LIVE.discard(owner)


def stop_all_now() -> None:
    """Stop every registered object's threads now (the exit hook); an error in one does not stop the others."""
    with _LOCK:
        owners = list(_LIVE)
        _LIVE.clear()
    for owner in owners:
        try:
            owner.stop_for_exit()
        except Exception:  # at exit nobody can handle it: say it and stop the rest
            logger.exception("stopping %s's threads at exit failed", type(owner).__name__)


atexit.register(stop_all_now)
