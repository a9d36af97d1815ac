"""Preemption-safe training: checkpoint on SIGTERM/SIGUSR1, requeue under SLURM, resume at the same iteration."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from ignite import distributed as idist
from ignite.engine import Engine, Events

from monai_fast.handlers import rng_state
from monai_fast.handlers.lifecycle import on_run_end

__all__ = ["Preemption"]

logger = logging.getLogger("monai_fast.handlers")

_PREFIX = "ckpt-"


class _SkipFirst:
    """A loader whose next ``iter()`` starts ``n`` batches in (the batches are produced, then dropped,
    so random transforms draw exactly as they did before the checkpoint)."""

    def __init__(self, loader: Any, n: int) -> None:
        self.loader, self.n = loader, n

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        n, self.n = self.n, 0
        for _ in range(n):
            next(it)
        return it

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _unwrap(obj: Any) -> Any:
    return obj.module if isinstance(obj, torch.nn.parallel.DistributedDataParallel) else obj


class Preemption:
    """Survive preemption: on a signal, finish the iteration, checkpoint atomically, requeue, stop.

    On ``SIGTERM`` or ``SIGUSR1`` (SLURM's ``--signal=USR1@120`` warning, or the ``SIGTERM`` of
    ``scancel`` / a spot-instance reclaim) the current iteration completes, then every rank agrees
    to stop at the same iteration, a checkpoint is written and, under SLURM, the job is requeued
    with ``scontrol requeue`` before the run terminates. When the signal lands in an epoch's last
    iteration or in validation, the checkpoint waits until the epoch's handlers (validation,
    per-epoch LR steps) have run.

    A checkpoint is a folder ``ckpt-<iteration>`` holding the state dicts of ``to_save`` (model,
    optimizer, ``GradScaler``, LR scheduler, the trainer itself, a ``SmartCacheUpdater``: anything
    with ``state_dict``) and, per rank, the random states at the start of the epoch, the random
    states now, and the position in the epoch. It is written under a temporary name and renamed
    when complete, so a folder named ``ckpt-*`` is always whole; a damaged one is skipped with a
    warning when resuming.

    :meth:`resume` (call it before ``run``) loads the newest checkpoint. A resumed run restores the
    epoch's starting random states, replays the data loader to the same batch (batches are
    produced and dropped, so random crops and augmentation draw as before) and continues at the
    next iteration: on a deterministic set-up its final weights equal an uninterrupted run's.

    Args:
        to_save: name -> object with ``state_dict``/``load_state_dict``; include the trainer.
            DDP-wrapped models are saved unwrapped.
        dirname: checkpoint folder (shared by all ranks).
        signals: signal names to catch (installed only from the main thread).
        requeue: ``scontrol requeue $SLURM_JOB_ID`` after the checkpoint; ``None``: when in a SLURM job.
        save_every: also checkpoint every this many iterations (a crash or SIGKILL then loses at
            most that many); ``None``: only on a signal.
        n_saved: checkpoints kept.

    Example:
        >>> from monai_fast.handlers import Preemption
        >>> pre = Preemption({"trainer": trainer, "model": net, "optimizer": opt}, "ckpt")  # doctest: +SKIP
        >>> pre.attach(trainer); pre.resume()  # doctest: +SKIP
        >>> trainer.run()  # doctest: +SKIP
        >>> pre.exit_if_preempted()  # doctest: +SKIP
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
        if not to_save:
            raise ValueError("to_save is empty: pass at least the model, the optimizer and the trainer")
        for name, obj in to_save.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"to_save[{name!r}] ({type(obj).__name__}) has no state_dict/load_state_dict")
        self.signals = []
        for name in signals:
            sig = getattr(signal, name, None)
            if not isinstance(sig, signal.Signals):
                raise ValueError(f"unknown signal {name!r}")  # noqa: TRY004 - a bad value, not a bad type
            self.signals.append(sig)
        if save_every is not None and save_every < 1:
            raise ValueError(f"save_every must be >= 1 or None, got {save_every}")
        if n_saved < 1:
            raise ValueError(f"n_saved must be >= 1, got {n_saved}")
        self.to_save = dict(to_save)
        self.dirname = Path(dirname)
        self.requeue = ("SLURM_JOB_ID" in os.environ) if requeue is None else requeue
        self.save_every = save_every
        self.n_saved = n_saved
        self.preempted = False
        self.resumed_from: int | None = None
        self._signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._engine: Engine | None = None
        self._epoch_start: dict | None = None
        self._pending: dict | None = None

    # ------------------------------------------------------------------ wiring
    def attach(self, engine: Engine) -> None:
        """Install the signal handlers and wire checkpointing and resume into ``engine``."""
        if self._engine is not None:
            raise RuntimeError("this Preemption is already attached")
        self._engine = engine
        engine.add_event_handler(Events.STARTED, self._on_started)
        # first at EPOCH_STARTED: the epoch's random states are taken (or restored) before anyone draws
        engine.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
        handlers = engine._event_handlers[Events.EPOCH_STARTED]
        handlers.insert(0, handlers.pop())
        engine.add_event_handler(Events.ITERATION_STARTED, self._on_iteration_started)
        on_run_end(engine, self._uninstall)

    def _on_started(self, engine: Engine) -> None:
        self._install()
        # last at ITERATION_COMPLETED and EPOCH_COMPLETED (registered now, after the user's
        # handlers): a checkpoint comes after per-iteration scheduler steps, validation and
        # per-epoch steps
        if not getattr(self, "_late_hooks", False):
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration_completed)
            engine.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch_completed)
            self._late_hooks = True

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Preemption: not on the main thread, cannot install signal handlers; "
                           "checkpoints only every save_every iterations")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _uninstall(self, engine: Engine) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signal = signum  # work happens at the next iteration boundary, not in the handler

    # ------------------------------------------------------------------ events
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
        now = getattr(self, "_restore_now", None)
        if now is not None:  # after the replayed batches: the main thread's states as at the checkpoint
            self._restore_now = None
            rng_state.restore({k: v for k, v in now.items() if k != "transforms"})

    def _agreed_stop(self) -> bool:
        flag = self._signal is not None
        if idist.get_world_size() > 1:
            flag = bool(idist.all_reduce(torch.tensor([int(flag)], device=idist.device()), op="MAX").item())
        return flag

    def _on_iteration_completed(self, engine: Engine) -> None:
        stop = self._agreed_stop()
        at = engine.state.iteration % engine.state.epoch_length
        if stop and at == 0:
            return  # the epoch's last iteration: checkpoint after its EPOCH_COMPLETED handlers
        if stop or (self.save_every and engine.state.iteration % self.save_every == 0 and at != 0):
            self.save(engine, at)
        if stop:
            self._stop(engine)

    def _on_epoch_completed(self, engine: Engine) -> None:
        stop = self._agreed_stop()
        periodic = bool(self.save_every and engine.state.iteration % self.save_every == 0)
        if stop or periodic:
            self.save(engine, 0)
        if stop:
            self._stop(engine)

    def _stop(self, engine: Engine) -> None:
        self.preempted = True
        name = signal.Signals(self._signal).name if self._signal else "a signal on another rank"
        logger.warning("Preemption: %s; checkpoint at iteration %d written, stopping", name, engine.state.iteration)
        if self.requeue and idist.get_rank() == 0:
            job = os.environ.get("SLURM_JOB_ID")
            if job is None:
                logger.error("Preemption: requeue=True but SLURM_JOB_ID is not set; not requeued")
            else:
                p = subprocess.run(["scontrol", "requeue", job], check=False, capture_output=True, text=True)
                if p.returncode == 0:
                    logger.warning("Preemption: SLURM job %s requeued; it resumes from the checkpoint", job)
                else:
                    logger.error("Preemption: 'scontrol requeue %s' failed: %s", job, p.stderr.strip())
        engine.terminate()

    def exit_if_preempted(self, code: int = 0) -> None:
        """``sys.exit(code)`` when the run stopped for preemption (call it right after ``run()``)."""
        if self.preempted:
            raise SystemExit(code)

    # ------------------------------------------------------------------ checkpoints
    def save(self, engine: Engine, epoch_iteration: int | None = None) -> Path:
        """Write a checkpoint now (all ranks must call it); returns its folder."""
        it = engine.state.iteration
        at = it % engine.state.epoch_length if epoch_iteration is None else epoch_iteration
        rank, world = idist.get_rank(), idist.get_world_size()
        final = self.dirname / f"{_PREFIX}{it:09d}"
        tmp = self.dirname / f".{_PREFIX}{it:09d}.tmp"
        if rank == 0:
            self.dirname.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        idist.barrier()
        mine = {
            "iteration": it,
            "epoch_iteration": at,
            "rng_epoch_start": self._epoch_start,
            "rng_now": rng_state.capture(self._data(engine)),
        }
        _atomic_save(mine, tmp / f"rank{rank}.pt")
        if rank == 0:
            _atomic_save({k: _unwrap(v).state_dict() for k, v in self.to_save.items()}, tmp / "state.pt")
        idist.barrier()
        if rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # the folder appears complete or not at all
            _fsync_dir(self.dirname)
            for old in self._complete()[self.n_saved:]:
                shutil.rmtree(old, ignore_errors=True)
        idist.barrier()
        logger.info("Preemption: checkpoint %s (%d ranks)", final, world)
        return final

    def _complete(self) -> list[Path]:
        if not self.dirname.is_dir():
            return []
        found = [p for p in self.dirname.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def resume(self) -> int | None:
        """Load the newest whole checkpoint into ``to_save``; returns its iteration (``None``: none).

        Folders that fail to load (truncated, another model) are skipped with a warning, newest
        first; under DDP all ranks agree on the checkpoint. Leftover temporary folders are removed.
        """
        if self._engine is None:
            raise RuntimeError("attach() the Preemption to the trainer before resume()")
        if idist.get_rank() == 0 and self.dirname.is_dir():
            for leftover in self.dirname.glob(f".{_PREFIX}*.tmp"):
                logger.warning("Preemption: removing the unfinished checkpoint %s", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
        candidates = self._complete()
        if idist.get_world_size() > 1:  # the same list on every rank (rank 0's view)
            listing = idist.broadcast("\n".join(str(p) for p in candidates), src=0, safe_mode=True)
            candidates = [Path(p) for p in listing.split("\n") if p]
        for folder in candidates:
            loaded = None
            try:
                state = torch.load(folder / "state.pt", map_location="cpu", weights_only=False)
                mine = torch.load(folder / f"rank{idist.get_rank()}.pt", map_location="cpu", weights_only=False)
                loaded = (state, mine)
            except Exception as exc:  # noqa: BLE001 - any damage means: try the next one
                logger.warning("Preemption: checkpoint %s cannot be read (%s); trying an older one", folder, exc)
            ok = loaded is not None
            if idist.get_world_size() > 1:
                ok = bool(idist.all_reduce(torch.tensor([int(ok)], device=idist.device()), op="MIN").item())
            if not ok:
                continue
            state, mine = loaded  # type: ignore[misc]
            missing = sorted(set(self.to_save) - set(state))
            if missing:
                raise KeyError(f"checkpoint {folder} has no state for {missing}; it holds {sorted(state)}")
            for name, obj in self.to_save.items():
                _unwrap(obj).load_state_dict(state[name])
            self._pending = mine
            self.resumed_from = int(mine["iteration"])
            logger.warning("Preemption: resumed from %s (iteration %d)", folder, self.resumed_from)
            return self.resumed_from
        return None


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
