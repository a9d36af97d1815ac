"""Background threads stopped before the interpreter exits, so that a stopped run ends cleanly.

A daemon thread that is inside torch's C++ code when the interpreter shuts down aborts the whole
process: CPython (up to 3.13) ends such a thread with ``pthread_exit`` as it reaches for the GIL, the
unwinding meets C++ frames that cannot be unwound, and the C++ runtime calls ``std::terminate``
("terminate called without an active exception", exit status -6). That is what happens whenever a
run ends while a loader thread is making a batch or a fill thread is caching an item: a trainer
stopped for preemption or by ``terminate()``, an exception, a signal during set-up. Under
``torchrun`` the aborted rank fails the whole job although its checkpoint was written.

Every monai-fast object that runs such a thread registers itself with `stop_at_exit()`; one
``atexit`` hook, which runs before the interpreter starts tearing down, asks each registered object
to stop (`ExitStoppable.stop_for_exit()`), which waits, bounded, for its threads to finish the
item they are on. The registry holds weak references only: an object that is gone needs no stop.

Examples:
    >>> import threading
    >>> class Ticker:
    ...     def __init__(self):
    ...         self.halt = threading.Event()
    ...         self.thread = threading.Thread(target=self.halt.wait, daemon=True)
    ...         self.thread.start()
    ...         stop_at_exit(self)  # stopped and joined before the interpreter exits
    ...     def stop_for_exit(self) -> None:
    ...         self.halt.set()
    ...         self.thread.join(5)
    >>> t = Ticker()
    >>> stop_all_now()  # what the exit hook does
    >>> t.thread.is_alive()
    False
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
