"""Preemption's first half: catch the stop signals, agree on the stop across ranks, requeue under SLURM.

See docs/preemption.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from ignite import distributed as idist

__all__ = [
    "STOPPED_EXIT",
    "STOP_SIGNALS",
    "StopSignal",
    "catch_stop_signals",
    "end_of_setup",
    "requeue_slurm_job",
    "stop_signals_caught",
]

logger = logging.getLogger("monai_fast.handlers")

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")  #: the signals of a preemption or a time limit (SLURM, spot reclaims, scancel)
STOPPED_EXIT = 143  #: exit status of a program stopped by a stop signal (128 + SIGTERM)

_setup_catcher: StopSignal | None = None  # the process's set-up catcher, until a StopSignal takes it over


class StopSignal:
    """Record that a stop signal arrived (a flag only); `agreed()` tells every rank at a safe point.

    Args:
        signals: signal names, e.g. ``("SIGTERM", "SIGUSR1")`` (`ValueError` for an unknown one).
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
        return bool(self._previous)

    @property
    def name(self) -> str:
        """The signal received here, or ``"a signal on another rank"``."""
        return signal.Signals(self.received).name if self.received is not None else "a signal on another rank"

    def install(self) -> None:
        """Put this object's handler on each signal (main thread only), taking over a set-up catcher."""
        if self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "Preemption: not on the main thread, cannot install signal handlers; "
                "checkpoints only every save_every iterations"
            )
            return
        _take_over_setup_catcher(self)
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Give each signal back the handler it had before `install()` (unless someone replaced ours since)."""
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


def _remove_setup_catcher() -> StopSignal | None:
    """Remove the set-up catcher (``None``: none), giving the signals their previous handlers back."""
    global _setup_catcher
    catcher, _setup_catcher = _setup_catcher, None
    if catcher is not None:
        catcher.uninstall()
    return catcher


def _take_over_setup_catcher(heir: StopSignal) -> None:
    """Remove the set-up catcher (unless ``heir`` itself), handing its recorded signal to ``heir``."""
    if _setup_catcher is None or _setup_catcher is heir:
        return
    catcher = _remove_setup_catcher()
    assert catcher is not None
    if catcher.received is not None and heir.received is None:
        heir.received = catcher.received
        logger.warning("%s received during set-up; the run stops at its start", catcher.name)


def catch_stop_signals(signals: Sequence[str] = STOP_SIGNALS) -> StopSignal:
    """Record stop signals from now on instead of dying of them; call it first thing in a program.

    Only signals with the default handler are caught, until the next `StopSignal` is installed or
    `end_of_setup()`; a second call returns the same catcher, whose ``received`` is the signal number.
    """
    global _setup_catcher
    if _setup_catcher is not None:
        return _setup_catcher
    catcher = StopSignal(signals)
    catcher.signals = [sig for sig in catcher.signals if signal.getsignal(sig) == signal.SIG_DFL]
    if threading.current_thread() is threading.main_thread() and catcher.signals:
        for sig in catcher.signals:
            catcher._previous[sig] = signal.signal(sig, catcher._on_signal)
        _setup_catcher = catcher
    return catcher


def end_of_setup(exit_code: int = STOPPED_EXIT) -> None:
    """The end of set-up in a program with no `Preemption`: signals act again as before.

    Raises:
        SystemExit: ``exit_code``, when a stop signal arrived during set-up.
    """
    catcher = _remove_setup_catcher()
    if catcher is not None and catcher.received is not None:
        logger.warning(
            "%s received during set-up; stopping before training (nothing trained, nothing to "
            "checkpoint), exit status %d",
            catcher.name,
            exit_code,
        )
        raise SystemExit(exit_code)


@contextlib.contextmanager
def stop_signals_caught(exit_code: int = STOPPED_EXIT, signals: Sequence[str] = STOP_SIGNALS) -> Iterator[StopSignal]:
    """Set-up inside a ``with`` block: a stop signal meanwhile stops the program at the block's end.

    Examples:
        >>> with stop_signals_caught():
        ...     pass  # build the data sets, caches and engines
    """
    owner = _setup_catcher is None
    catcher = catch_stop_signals(signals)
    try:
        yield catcher
    except BaseException:
        if owner and _setup_catcher is catcher:
            _remove_setup_catcher()  # the exception is the news
        raise
    if owner:
        end_of_setup(exit_code)


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
