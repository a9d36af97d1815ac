"""Preemption's first half: catch the stop signals, agree on the stop across ranks, requeue under SLURM.

The second half, the checkpoint folder, is :mod:`monai_fast.handlers.checkpoint_folder`;
:class:`~monai_fast.handlers.Preemption` joins the two to an engine.

Example:
    >>> import os, signal
    >>> from monai_fast.handlers.stop_signal import StopSignal
    >>> stop = StopSignal(("SIGUSR1",))
    >>> stop.install()
    >>> os.kill(os.getpid(), signal.SIGUSR1)
    >>> stop.name, stop.agreed()
    ('SIGUSR1', True)
    >>> stop.uninstall()
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

import torch
from ignite import distributed as idist

__all__ = ["StopSignal", "requeue_slurm_job"]

logger = logging.getLogger("monai_fast.handlers")


class StopSignal:
    """Record that a stop signal arrived; the work happens later, at a safe point, on every rank.

    The handler only sets a flag (nothing else is safe inside a signal handler). :meth:`agreed`
    is a collective: every rank calls it at the same point and all get ``True`` when any rank was
    signalled, so they stop at the same iteration.

    Args:
        signals: signal names, e.g. ``("SIGTERM", "SIGUSR1")``.

    Raises:
        ValueError: an unknown signal name.
    """

    def __init__(self, signals: Sequence[str]) -> None:
        self.signals: list[signal.Signals] = []
        for name in signals:
            sig = getattr(signal, name, None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(f"unknown signal {name!r}")  # noqa: TRY004 - a bad value, not a bad type
            self.signals.append(sig)
        self.received: int | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def installed(self) -> bool:
        """Whether this object's handlers are in place."""
        return bool(self._previous)

    @property
    def name(self) -> str:
        """The signal received here, or ``"a signal on another rank"``."""
        return signal.Signals(self.received).name if self.received is not None else "a signal on another rank"

    def install(self) -> None:
        """Put this object's handler on each signal, remembering the previous handlers (main thread only)."""
        if self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Preemption: not on the main thread, cannot install signal handlers; "
                           "checkpoints only every save_every iterations")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Give each signal back the handler it had before :meth:`install`.

        A signal whose handler someone replaced after ours keeps theirs.
        """
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = signum  # work happens at the next safe point, not in the handler

    def agreed(self) -> bool:
        """Whether any rank got a signal (a collective under DDP: all ranks call it together)."""
        flag = self.received is not None
        if idist.get_world_size() > 1:
            flag = bool(idist.all_reduce(torch.tensor([int(flag)], device=idist.device()), op="MAX").item())
        return flag


def requeue_slurm_job() -> bool:
    """``scontrol requeue $SLURM_JOB_ID``; logs the outcome and returns whether it worked."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        logger.error("Preemption: requeue=True but SLURM_JOB_ID is not set; not requeued")
        return False
    try:
        p = subprocess.run(["scontrol", "requeue", job], check=False, capture_output=True, text=True)
    except OSError as exc:
        logger.error("Preemption: 'scontrol requeue %s' could not run: %s", job, exc)
        return False
    if p.returncode != 0:
        logger.error("Preemption: 'scontrol requeue %s' failed: %s", job, p.stderr.strip())
        return False
    logger.warning("Preemption: SLURM job %s requeued; it resumes from the checkpoint", job)
    return True
