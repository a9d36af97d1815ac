"""Preemption-safe training: checkpoint on SIGTERM/SIGUSR1, requeue under SLURM, resume at the same iteration.

`StopSignal` catches the stop signals and agrees on the stop across ranks; `Preemption` checkpoints into a
`monai_fast.handlers.checkpoint_folder.CheckpointFolder` and resumes from it (docs/preemption.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from ignite import distributed as idist
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint

from monai_fast.data import rng_state
from monai_fast.handlers.checkpoint_folder import CheckpointFolder
from monai_fast.handlers.lifecycle import EngineHandler

__all__ = [
    "STOPPED_EXIT",
    "STOP_SIGNALS",
    "Preemption",
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
        if _setup_catcher is not None and _setup_catcher is not self:  # take over the set-up catcher's signal
            catcher = _remove_setup_catcher()
            if catcher is not None and catcher.received is not None and self.received is None:
                self.received = catcher.received
                logger.warning("%s received during set-up; the run stops at its start", catcher.name)
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


_KEY = "preemption"  # the to_save entry holding every rank's random states and position


class _SkipFirst:
    """A loader whose next pass starts ``n`` batches in (made and dropped) and counts only the batches to come."""

    def __init__(self, loader: Any, n: int) -> None:
        self.loader, self.n = loader, n
        self._dropped = 0  # batches dropped at the start of the current pass

    def __len__(self) -> int:
        if self._dropped:
            return len(self.loader) * int(getattr(self.loader, "repeats", 1)) - self._dropped
        return len(self.loader)

    @property
    def repeats(self) -> int:  # 1 during the shortened pass: its length counts them already
        return 1 if self._dropped else int(getattr(self.loader, "repeats", 1))

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        n, self.n = self.n, 0
        self._dropped = n
        for _ in range(n):
            next(it)
        return it

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _RankStates:
    """The checkpoint entry of every rank's random states and epoch position (gathered before a save)."""

    def __init__(self) -> None:
        self.value: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.value = dict(state)


class Preemption(EngineHandler):
    """Survive preemption: on a signal, finish the iteration, checkpoint atomically, requeue, stop.

    Every rank stops at the same iteration and one whole ``ckpt-<iteration>.pt`` is written; `resume()`
    loads the newest readable one and replays the loader to the same batch. See docs/preemption.md.

    Args:
        to_save: name -> object with ``state_dict``/``load_state_dict``, the engine included.
        dirname: checkpoint folder (shared by all ranks).
        signals: signal names to catch (installed only from the main thread).
        requeue: ``scontrol requeue $SLURM_JOB_ID`` after the checkpoint; ``None``: when in a SLURM job.
        save_every: also checkpoint every this many iterations; ``None``: only on a signal.
        n_saved: valid checkpoints kept.

    Examples:
        >>> pre = Preemption({"trainer": trainer, "model": net, "optimizer": opt}, "ckpt")  # doctest: +SKIP
        >>> pre.attach(trainer); pre.resume(); trainer.run(); pre.exit_if_preempted()  # doctest: +SKIP
    """

    def __init__(
        self,
        to_save: Mapping[str, Any],
        dirname: str | os.PathLike,
        signals: Sequence[str] = ("SIGTERM", "SIGUSR1"),
        requeue: bool | None = None,
        save_every: int | None = None,
        n_saved: int = 2,
    ) -> None:
        super().__init__()
        if not to_save:
            raise ValueError("to_save is empty: pass at least the model, the optimizer and the trainer")
        for name, obj in to_save.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"to_save[{name!r}] ({type(obj).__name__}) has no state_dict/load_state_dict")
        if _KEY in to_save:
            raise ValueError(f"to_save[{_KEY!r}] is reserved for Preemption's own state; rename that entry")
        if save_every is not None and save_every < 1:
            raise ValueError(f"save_every must be >= 1 or None, got {save_every}")
        if n_saved < 1:
            raise ValueError(f"n_saved must be >= 1, got {n_saved}")
        self.stop_signal = StopSignal(signals)
        self.to_save = dict(to_save)
        self.dirname = Path(dirname)
        self.requeue = ("SLURM_JOB_ID" in os.environ) if requeue is None else requeue
        self.save_every = save_every
        self.n_saved = n_saved
        self.preempted = False
        self.resumed_from: int | None = None
        self._ranks = _RankStates()
        self._folder: CheckpointFolder | None = None
        self._epoch_start: dict | None = None
        self._pending: dict | None = None
        self._restore_now: dict | None = None
        self._loaded: tuple[int, int] | None = None  # (iteration, epoch) resumed, until the run starts
        self._late_hooks = False

    def _attach(self, engine: Engine) -> None:
        if not any(obj is engine for obj in self.to_save.values()):
            raise ValueError(
                "Preemption: to_save must include the engine it is attached to (e.g. "
                "to_save['trainer'] = trainer), or a resumed run would start again at iteration 1"
            )
        self._folder = CheckpointFolder({**self.to_save, _KEY: self._ranks}, self.dirname, self.n_saved)
        # first: the run's state and the epoch's random states are restored before anyone else draws
        self.on(engine, Events.STARTED, self._on_started, first=True)
        self.on(engine, Events.EPOCH_STARTED, self._on_epoch_started, first=True)
        self.on(engine, Events.ITERATION_STARTED, self._on_iteration_started)
        self.on_run_end(engine, self._run_ended)
        self.stop_signal.install()

    def _detached(self, engine: Engine) -> None:
        self.stop_signal.uninstall()
        self._late_hooks = False

    def _run_ended(self, engine: Engine) -> None:
        self.stop_signal.uninstall()

    def _on_started(self, engine: Engine) -> None:
        self.stop_signal.install()  # again, for a second run of the same engine
        loaded, self._loaded = self._loaded, None
        if loaded is not None and engine.state.iteration != loaded[0]:
            # ignite starts a finished run again from iteration 0: keep it finished instead
            engine.state.iteration, engine.state.epoch = loaded
            self._pending = None
            logger.warning(
                "Preemption: the checkpoint at iteration %d is the end of the run (max_epochs=%s): "
                "nothing to do; raise max_epochs to train further",
                loaded[0],
                engine.state.max_epochs,
            )
            return
        # last (registered now, after the user's handlers): a checkpoint comes after their steps and validation
        if not self._late_hooks:
            self.on(engine, Events.ITERATION_COMPLETED, self._on_iteration_completed)
            self.on(engine, Events.EPOCH_COMPLETED, self._on_epoch_completed)
            self._late_hooks = True
        if self.stop_signal.agreed():  # signalled before the run: nothing trained since the last checkpoint
            logger.warning("Preemption: %s before the run started; stopping at once", self.stop_signal.name)
            self._stop(engine, saved=False)

    def _data(self, engine: Engine) -> Any:
        return getattr(engine, "data_loader", None) or engine.state.dataloader

    def _on_epoch_started(self, engine: Engine) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            at = pending["epoch_iteration"]
            if at == 0:  # checkpoint at an epoch's end: continue from the random states of that moment
                rng_state.restore(pending["rng_now"], self._data(engine))
            else:  # mid-epoch: replay the epoch's first `at` batches from its starting random states
                rng_state.restore(pending["rng_epoch_start"], self._data(engine))
                engine.state.dataloader = _SkipFirst(engine.state.dataloader, at)
                self._restore_now = pending["rng_now"]
        self._epoch_start = rng_state.capture(self._data(engine))

    def _on_iteration_started(self, engine: Engine) -> None:
        now, self._restore_now = self._restore_now, None
        if now is not None:  # after the replayed batches: the main thread's states as at the checkpoint
            rng_state.restore({k: v for k, v in now.items() if k != "transforms"})

    def _on_iteration_completed(self, engine: Engine) -> None:
        stop = self.stop_signal.agreed()
        at = engine.state.iteration % engine.state.epoch_length
        if stop and at == 0:
            return  # the epoch's last iteration: checkpoint after its EPOCH_COMPLETED handlers
        if stop or (self.save_every and engine.state.iteration % self.save_every == 0 and at != 0):
            self.save(engine, at)
        if stop:
            self._stop(engine)

    def _on_epoch_completed(self, engine: Engine) -> None:
        stop = self.stop_signal.agreed()
        periodic = bool(self.save_every and engine.state.iteration % self.save_every == 0)
        if stop or periodic:
            self.save(engine, 0)
        if stop:
            self._stop(engine)

    def _stop(self, engine: Engine, saved: bool = True) -> None:
        self.preempted = True
        what = f"checkpoint at iteration {engine.state.iteration} written" if saved else "no new checkpoint needed"
        logger.warning("Preemption: %s; %s, stopping", self.stop_signal.name, what)
        if self.requeue and idist.get_rank() == 0:
            requeue_slurm_job()
        engine.terminate()

    def exit_if_preempted(self, code: int | None = None) -> None:
        """``sys.exit`` when the run stopped for preemption (call it right after ``run()``).

        By default with 0 where it requeued its SLURM job (SLURM runs it again) and `STOPPED_EXIT` (143) elsewhere:
        a supervisor that restarts a failed job (Kubernetes, SageMaker, ``monai-fast launch``'s callers) restarts
        it, and none takes it for done.
        """
        if self.preempted:
            raise SystemExit((0 if self.requeue else STOPPED_EXIT) if code is None else code)

    def save(self, engine: Engine, epoch_iteration: int | None = None) -> Path:
        """Write a checkpoint now (all ranks must call it); returns its file."""
        if self._folder is None:
            raise RuntimeError("attach() the Preemption to the trainer before save()")
        it = engine.state.iteration
        at = it % engine.state.epoch_length if epoch_iteration is None else epoch_iteration
        mine = {"rng_epoch_start": self._epoch_start, "rng_now": rng_state.capture(self._data(engine))}
        ranks = idist.all_gather(mine) if idist.get_world_size() > 1 else [mine]
        self._ranks.value = {"iteration": it, "epoch_iteration": at, "ranks": list(ranks)}
        path = self._folder.write(engine)
        logger.info("Preemption: checkpoint %s (%d ranks)", path, len(ranks))
        return path

    def resume(self) -> int | None:
        """Load the newest readable checkpoint (all ranks agree) into ``to_save``; returns its iteration or ``None``.

        Raises:
            KeyError: the checkpoint has no state for an entry of ``to_save`` (names the file).
            RuntimeError: a state does not fit its object, e.g. another model's (names the file).
        """
        if self._folder is None or self.engine is None:
            raise RuntimeError("attach() the Preemption to the trainer before resume()")
        found = self._folder.newest_loadable()
        if found is None:
            return None
        path, state = found
        missing = sorted(set(self.to_save) - set(state))
        if missing:
            raise KeyError(f"checkpoint {path} has no state for {missing}; it holds {sorted(state)}")
        engine = self.engine
        max_epochs = engine.state.max_epochs
        try:
            Checkpoint.load_objects(self.to_save, {k: state[k] for k in self.to_save})
        except Exception as exc:
            raise RuntimeError(f"checkpoint {path} does not fit to_save (another run's folder?): {exc}") from exc
        if max_epochs is not None:  # the trainer's max_epochs, not the checkpoint's: raise it to train further
            engine.state.max_epochs = max(max_epochs, engine.state.epoch)
        ours = state.get(_KEY) or {}
        ranks = ours.get("ranks") or []
        if len(ranks) != idist.get_world_size():
            logger.warning(
                "Preemption: %s was written by %d rank(s), this run has %d: random states not restored",
                path,
                len(ranks),
                idist.get_world_size(),
            )
            self._pending = None
        else:
            self._pending = {**ranks[idist.get_rank()], "epoch_iteration": ours["epoch_iteration"]}
        self._loaded = (engine.state.iteration, engine.state.epoch)
        self.resumed_from = int(engine.state.iteration)
        logger.warning("Preemption: resumed from %s (iteration %d)", path, self.resumed_from)
        return self.resumed_from
