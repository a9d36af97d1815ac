"""Run a local launcher (torchrun) as a child, pass stop signals to its ranks, leave no process behind."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType

import psutil

__all__ = ["FORWARDED", "NoRankStarted", "exit_status", "supervise"]

logger = logging.getLogger("monai_fast.distributed")

FORWARDED: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  #: passed on to the ranks

_LAUNCHER_EXIT_S = 10.0  # after the ranks are killed, how long torchrun may take to report them
_REMIND_S = 30.0  # while no rank has started, how often the wait is logged


class NoRankStarted(TimeoutError):
    """The launcher started no rank within ``start_timeout_s`` (it was waiting for its rendezvous); it was stopped."""


def exit_status(returncode: int) -> int:
    """A child's ``Popen.returncode`` as a shell reports it: killed by signal N (``-N``) is ``128 + N``."""
    return 128 - returncode if returncode < 0 else returncode


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class _Supervision:
    """The state of one supervised launcher: its ranks, the signals received, the deadline."""

    proc: subprocess.Popen  # set by start()

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.received: list[signal.Signals] = []
        self.ranks: dict[int, psutil.Process] = {}
        self.delivered: dict[int, int] = {}  # pid -> how many of ``received`` it was sent
        self.deadline: float | None = None
        self.started_at = time.monotonic()
        self._launcher: psutil.Process | None = None

    def start(self, cmd: list[str], env: dict[str, str] | None) -> None:
        """Start the launcher in a session of its own (a signal to our group reaches it only through us)."""
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        with contextlib.suppress(psutil.NoSuchProcess):  # it ended already
            self._launcher = psutil.Process(self.proc.pid)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        logger.warning("%s received: passing it to the ranks, %.0f s for them to stop", sig.name, self.grace_s)
        self.received.append(sig)
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s
        if not self.ranks:  # still at the rendezvous: nothing to checkpoint, the launcher itself stops
            self.deadline = min(self.deadline, time.monotonic() + _LAUNCHER_EXIT_S)
            self.signal_launcher(sig)

    def signal_launcher(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the launcher's own process group (it leads a session of its own)."""
        with contextlib.suppress(ProcessLookupError, PermissionError, AttributeError):
            os.killpg(self.proc.pid, sig)

    def find_ranks(self) -> None:
        """Remember the launcher's children (torchrun's ranks) while it lives: orphans are found by pid later."""
        if self._launcher is None or not _alive(self._launcher):
            return
        try:
            children = self._launcher.children()
        except psutil.Error:
            return
        for child in children:
            self.ranks.setdefault(child.pid, child)

    def alive_ranks(self) -> list[psutil.Process]:
        return [p for p in self.ranks.values() if _alive(p)]

    def deliver(self) -> None:
        """Send every rank the signals it has not been sent yet (a rank started late gets them all)."""
        for rank in self.alive_ranks():
            for sig in self.received[self.delivered.get(rank.pid, 0) :]:
                try:
                    rank.send_signal(sig)
                except psutil.Error:
                    break
            self.delivered[rank.pid] = len(self.received)

    def kill_all(self) -> None:
        """SIGKILL each rank's process group (or the rank alone when it leads none), then its other descendants."""
        for rank in self.alive_ranks():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                family = rank.children(recursive=True)
                if os.getpgid(rank.pid) == rank.pid:
                    os.killpg(rank.pid, signal.SIGKILL)
                else:
                    rank.kill()
                for p in family:
                    p.kill()


def _stop_launcher(s: _Supervision) -> None:
    """Kill the launcher and its process group, and reap it."""
    s.kill_all()
    s.signal_launcher(signal.SIGKILL)
    s.proc.kill()
    s.proc.wait()


def _wait(s: _Supervision, poll_s: float, start_timeout_s: float | None) -> None:
    reminded = s.started_at
    while True:
        s.find_ranks()
        launcher_done = s.proc.poll() is not None
        if launcher_done and not s.alive_ranks():
            return
        now = time.monotonic()
        if start_timeout_s is not None and not s.ranks and not s.received and not launcher_done:
            if now - s.started_at > start_timeout_s:
                _stop_launcher(s)
                raise NoRankStarted(f"the launcher started no rank within {start_timeout_s:g} s: stopped")
            if now - reminded >= _REMIND_S:
                reminded = now
                logger.info("still waiting for the rendezvous: %.0f s left", start_timeout_s - (now - s.started_at))
        if launcher_done and not s.received:  # orphans: the launcher died under them
            orphans = sorted(p.pid for p in s.alive_ranks())
            logger.warning(
                "the launcher ended (status %s) but ranks %s live on: stopping them", s.proc.returncode, orphans
            )
            s.on_signal(signal.SIGTERM, None)
        s.deliver()
        if s.deadline is not None and time.monotonic() > s.deadline:
            if s.ranks:
                left = sorted(p.pid for p in s.alive_ranks()) or "the launcher"
                logger.warning("the ranks did not stop within %.0f s: killing %s", s.grace_s, left)
            else:
                logger.warning(
                    "the launcher, still at its rendezvous, did not stop within %.0f s: killing it", _LAUNCHER_EXIT_S
                )
                _stop_launcher(s)
                return
            s.kill_all()
            try:
                s.proc.wait(_LAUNCHER_EXIT_S)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
            return
        time.sleep(poll_s)


def supervise(
    cmd: Sequence[str],
    grace_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    poll_s: float = 0.1,
    start_timeout_s: float | None = None,
) -> int:
    """Run ``cmd`` (a launcher such as torchrun) to its end, passing ``FORWARDED`` signals to its children.

    After the first signal the ranks get ``grace_s`` to checkpoint, then each rank's process group and
    the launcher are killed. Signal handlers are installed only from the main thread and restored on return.

    Args:
        cmd: the launcher's command line.
        grace_s: after the first signal, how long the ranks may take to stop before they are killed.
        env: the launcher's environment (default: this process's).
        poll_s: how often the children are looked for and their state checked.
        start_timeout_s: how long the launcher may take to start its first rank; ``None``: no limit.

    Returns:
        The launcher's exit status, ``128 + N`` if signal N killed it.

    Raises:
        NoRankStarted: no rank started within ``start_timeout_s`` (the launcher is killed first).
    """
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    s = _Supervision(grace_s)
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, s.on_signal) for sig in FORWARDED} if main else {}
    try:
        s.start(list(cmd), None if env is None else dict(env))  # after the handlers: no signal is missed
        _wait(s, poll_s, start_timeout_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if hasattr(s, "proc") and s.proc.poll() is None:  # an error in here: never leave the launcher behind
            _stop_launcher(s)
    return exit_status(s.proc.returncode)
