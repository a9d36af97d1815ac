"""When the validation runs: only when a cheap estimate says the target is near (`ValidationSchedule`), or on a
snapshot of the weights while training goes on (`BackgroundValidation`); and when a validation metric at its target,
or a spent wall-clock budget, ends the training (`TimeToTarget`)."""

from __future__ import annotations

import copy
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Literal

import torch
from ignite.engine import Engine, Events
from ignite.metrics import Metric
from monai.engines import Evaluator, SupervisedEvaluator
from monai.inferers import Inferer

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.record import add_row
from monai_fast.telemetry.cuda import side_stream
from monai_fast.telemetry.record import Kind, Source

__all__ = ["BackgroundValidation", "BackgroundValidationError", "TimeToTarget", "ValidationSchedule", "estimator_like"]

THREAD_NAME = "monai-fast-validation"


class BackgroundValidationError(RuntimeError):
    """The background validation of an epoch's weights failed; the cause is chained."""


class BackgroundValidation(EngineHandler):
    """Runs ``evaluator`` on a snapshot of the trainer's weights in a background thread.

    Every ``interval``-th epoch (and the last) the weights are copied into a private network and
    ``evaluator.run(epoch)`` starts in a thread; a failure is raised on the training thread as
    `BackgroundValidationError` naming the epoch. See docs/data.md.

    Args:
        evaluator: a MONAI ``Evaluator`` with a ``network`` (e.g. ``SupervisedEvaluator``).
        interval: validate every this many epochs.
        when_busy: ``"skip"`` or ``"wait"`` when the previous validation is still running.
        threads: ``(training, validation)`` intra-op threads on CPU.

    Examples:
        >>> BackgroundValidation(evaluator).attach(trainer)  # instead of ValidationHandler  # doctest: +SKIP
    """

    def __init__(
        self,
        evaluator: Evaluator,
        interval: int = 1,
        when_busy: Literal["skip", "wait"] = "skip",
        threads: tuple[int, int] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        if not isinstance(evaluator, Evaluator) or not isinstance(getattr(evaluator, "network", None), torch.nn.Module):
            raise TypeError(
                "BackgroundValidation: evaluator must be a MONAI Evaluator with a network, "
                f"got {type(evaluator).__name__}"
            )
        if not (isinstance(interval, int) and interval >= 1):
            raise ValueError(f"BackgroundValidation: interval must be an int >= 1, got {interval!r}")
        if when_busy not in ("skip", "wait"):
            raise ValueError(f"BackgroundValidation: when_busy must be 'skip' or 'wait', got {when_busy!r}")
        if threads is not None and (len(threads) != 2 or min(threads) < 1):
            raise ValueError(
                f"BackgroundValidation: threads must be (training, validation), each >= 1, got {threads!r}"
            )
        super().__init__()
        self.evaluator, self.interval, self.when_busy = evaluator, interval, when_busy
        half = max(1, torch.get_num_threads() // 2)
        self.threads = tuple(threads) if threads is not None else (half, half)
        self.logger = logger or logging.getLogger("monai_fast.handlers")
        self.validated_epochs: list[int] = []  # epochs whose weights were validated, in order
        self.skipped_epochs: list[int] = []  # epochs left out because a validation was still running
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._source: torch.nn.Module | None = None
        self._own_network: torch.nn.Module | None = None
        self._threads_before = torch.get_num_threads()

    def _attach(self, trainer: Engine) -> None:
        network = getattr(trainer, "network", None)
        if not isinstance(network, torch.nn.Module):
            raise TypeError(
                "BackgroundValidation: the trainer must have a network (a MONAI SupervisedTrainer), "
                f"got {type(trainer).__name__}"
            )
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # the evaluator's metric all-reduce would interleave with DDP's gradient all-reduce
            raise ValueError(
                "BackgroundValidation: not in a multi-process run (collectives from two threads); "
                "use ValidationSchedule"
            )
        self._source = getattr(network, "module", network)  # DDP: the bare module, as the evaluator uses
        self._own_network = self.evaluator.network
        self.evaluator.network = copy.deepcopy(self._source)  # the snapshot, only ever written between validations
        self.on(trainer, Events.STARTED, self._started)
        self.on(trainer, Events.ITERATION_COMPLETED, self._raise_error)
        self.on(trainer, Events.EPOCH_COMPLETED, self._epoch_completed)
        for event in (Events.TERMINATE, Events.COMPLETED):  # before the run-end hooks: an error is raised, not logged
            self.on(trainer, event, self._completed, first=True)
        self.on_run_end(trainer, self._stop)

    def _detached(self, engine: Engine) -> None:
        self._stop(engine)
        if self._own_network is not None:
            self.evaluator.network = self._own_network

    def _started(self, trainer: Engine) -> None:
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads[0])

    def _raise_error(self, trainer: Engine | None = None) -> None:
        if self._error is not None:
            (epoch, error), self._error = self._error, None
            raise BackgroundValidationError(
                f"background validation of epoch {epoch}'s weights failed: {error!r}"
            ) from error

    def _epoch_completed(self, trainer: Engine) -> None:
        self._raise_error()
        epoch = trainer.state.epoch
        last = trainer.state.max_epochs is not None and epoch >= trainer.state.max_epochs
        if epoch % self.interval and not last:
            return
        if self._thread is not None and self._thread.is_alive():
            if self.when_busy == "skip" and not last:
                self.skipped_epochs.append(epoch)
                self.logger.debug("background validation still running: epoch %d not validated", epoch)
                return
            self._thread.join()
            self._raise_error()
        assert self._source is not None
        with torch.no_grad():
            self.evaluator.network.load_state_dict(self._source.state_dict())
        self.validated_epochs.append(epoch)
        self._thread = threading.Thread(target=self._validate, args=(trainer, epoch), name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _validate(self, trainer: Engine, epoch: int) -> None:
        torch.set_num_threads(self.threads[1])
        start = time.perf_counter()
        try:
            with side_stream(self.evaluator.state.device or "cpu"):
                self.evaluator.run(epoch)
        except BaseException as e:  # handed to the training thread, never dropped
            self._error = (epoch, e)
            return
        full_s = time.perf_counter() - start
        add_row(trainer, Kind.EPOCH, Source.VALIDATION, epoch=epoch, background=True, full=True, full_s=full_s)

    def _completed(self, trainer: Engine) -> None:
        if self._thread is not None:
            self._thread.join()
        self._raise_error()

    def _stop(self, trainer: Engine) -> None:
        thread, self._thread = self._thread, None
        failing = sys.exc_info()[1] is not None  # called from the run's exception hook: the run is failing
        if thread is not None and thread.is_alive():
            if failing:
                self.evaluator.terminate()  # stop at the next batch; nobody will read the result
            thread.join()
        if self._error is not None and failing:
            (epoch, error), self._error = self._error, None
            self.logger.error("background validation of epoch %d's weights also failed: %r", epoch, error)
        torch.set_num_threads(self._threads_before)


def estimator_like(
    evaluator: SupervisedEvaluator,
    val_data_loader: Iterable,
    key_val_metric: dict[str, Metric],
    postprocessing: Callable | None = None,
    inferer: Inferer | None = None,
) -> SupervisedEvaluator:
    """A cheap copy of ``evaluator`` over ``val_data_loader``: same network, device, batch preparation and precision.

    ``inferer`` defaults to the evaluator's own; ``key_val_metric`` is copied (it may be the evaluator's dict);
    pass the ``postprocessing`` again (MONAI keeps no public handle on it).
    """
    return SupervisedEvaluator(
        device=evaluator.state.device,
        val_data_loader=val_data_loader,
        network=evaluator.network,
        prepare_batch=evaluator.prepare_batch,
        inferer=inferer if inferer is not None else evaluator.inferer,
        postprocessing=postprocessing,
        key_val_metric=copy.deepcopy(key_val_metric),
        amp=evaluator.amp,
        amp_kwargs=evaluator.amp_kwargs,
        non_blocking=evaluator.non_blocking,
    )


class ValidationSchedule(EngineHandler):
    """Decides after each trainer epoch whether the full validation is worth running.

    A cheap ``estimator`` (see `estimator_like()`) runs after every epoch while the target is far; the
    full ``evaluator`` every ``every`` epochs, on the last one, and every epoch once an estimate came
    within ``margin`` (``close_epoch``). Use it instead of MONAI's ``ValidationHandler``; attach `TimeToTarget`
    to the full ``evaluator`` (docs/data.md).

    Args:
        evaluator: the full validation (a MONAI ``Evaluator``).
        estimator: the cheap estimate (a MONAI ``Evaluator``, not ``evaluator``).
        target: the metric value the run aims at.
        margin: "close" is ``estimate >= target - margin`` (``mode="max"``), ``<= target + margin`` (``"min"``).
        every: while far, full validation every this many epochs.
        metric_name: the metric in both engines' ``state.metrics``; default: the key metric.
        mode: ``"max"`` if higher is better (Dice), ``"min"`` if lower is.

    Examples:
        >>> ValidationSchedule(evaluator, estimator, target=0.9, every=5).attach(trainer)  # doctest: +SKIP
    """

    def __init__(
        self,
        evaluator: Evaluator,
        estimator: Evaluator,
        target: float,
        margin: float = 0.05,
        every: int = 5,
        metric_name: str | None = None,
        mode: Literal["max", "min"] = "max",
        logger: logging.Logger | None = None,
    ) -> None:
        for name, e in (("evaluator", evaluator), ("estimator", estimator)):
            if not isinstance(e, Evaluator):
                raise TypeError(f"ValidationSchedule: {name} must be a MONAI Evaluator, got {type(e).__name__}")
        if estimator is evaluator:
            raise ValueError(
                "ValidationSchedule: estimator must be another engine than evaluator (a subset, a coarser overlap)"
            )
        if not math.isfinite(target):
            raise ValueError(f"ValidationSchedule: target must be a finite number, got {target}")
        if not (math.isfinite(margin) and margin >= 0):
            raise ValueError(f"ValidationSchedule: margin must be >= 0, got {margin}")
        if not (isinstance(every, int) and every >= 1):
            raise ValueError(f"ValidationSchedule: every must be an int >= 1, got {every!r}")
        if mode not in ("max", "min"):
            raise ValueError(f"ValidationSchedule: mode must be 'max' or 'min', got {mode!r}")
        super().__init__()
        self.evaluator, self.estimator = evaluator, estimator
        self.target, self.margin, self.every = float(target), float(margin), every
        self.metric_name, self.mode = metric_name, mode
        self.logger = logger or logging.getLogger("monai_fast.handlers")
        self.estimates: list[tuple[int, float]] = []  # (trainer epoch, estimate)
        self.full_epochs: list[int] = []  # trainer epochs after which the full validation ran
        self.close_epoch: int | None = None  # the first epoch whose estimate was within the margin

    def _attach(self, trainer: Engine) -> None:
        self.on(trainer, Events.EPOCH_COMPLETED, self._epoch_completed)

    def _estimate(self, epoch: int) -> float:
        self.estimator.run(epoch)
        name = self.metric_name or self.estimator.state.key_metric_name
        if name not in self.estimator.state.metrics:
            raise KeyError(
                f"ValidationSchedule: metric {name!r} not in the estimator's metrics "
                f"{sorted(self.estimator.state.metrics)}; pass metric_name="
            )
        return float(self.estimator.state.metrics[name])

    def is_close(self, estimate: float) -> bool:
        """Whether ``estimate`` is within the margin of the target (or past it)."""
        return estimate >= self.target - self.margin if self.mode == "max" else estimate <= self.target + self.margin

    def _epoch_completed(self, trainer: Engine) -> None:
        epoch = trainer.state.epoch
        estimate = None
        if self.close_epoch is None:
            estimate = self._estimate(epoch)
            self.estimates.append((epoch, estimate))
            if self.is_close(estimate):
                self.close_epoch = epoch
                self.logger.info(
                    "estimate %.4f within %.3f of target %.3f at epoch %d: full validation every epoch",
                    estimate,
                    self.margin,
                    self.target,
                    epoch,
                )
        last = trainer.state.max_epochs is not None and epoch >= trainer.state.max_epochs
        full = self.close_epoch is not None or epoch % self.every == 0 or last
        if full:
            self.evaluator.run(epoch)
            self.full_epochs.append(epoch)
        add_row(
            trainer,
            Kind.EPOCH,
            Source.VALIDATION,
            epoch=epoch,
            estimate=estimate,
            full=full,
            estimate_s=self.estimator.state.times.get("COMPLETED") if estimate is not None else None,
            full_s=self.evaluator.state.times.get("COMPLETED") if full else None,
        )


class TimeToTarget(EngineHandler):
    """Measures wall-clock time to a target metric and ends the run there.

    The clock starts at ``start_time`` (taken before building the data sets, so caching counts) or at
    `attach()`. `history` holds ``(elapsed_s, validated_epoch, value)`` per reading; ``reached_s`` /
    ``reached_epoch`` the first met, ``stable_s`` / ``stable_epoch`` the second in a row; see docs/monitoring.md.

    Args:
        target: the value to reach.
        metric_name: key in ``engine.state.metrics``; default: the evaluator's key metric.
        time_budget_s: stop after this many seconds (``budget_exhausted`` then); ``None`` for no limit.
        start_time: `time.perf_counter()` value at which the clock started.
        mode: ``"max"`` if higher is better (Dice), ``"min"`` if lower is (loss).
        stop_on: ``"first"`` reading at the target, or ``"stable"``: the second consecutive one.

    Examples:
        >>> stopper = TimeToTarget(target=0.9, time_budget_s=600, start_time=time.perf_counter())
        >>> stopper.attach(trainer, evaluator)  # doctest: +SKIP
    """

    def __init__(
        self,
        target: float,
        metric_name: str | None = None,
        time_budget_s: float | None = None,
        start_time: float | None = None,
        mode: Literal["max", "min"] = "max",
        logger: logging.Logger | None = None,
        stop_on: Literal["first", "stable"] = "first",
    ) -> None:
        if not math.isfinite(target):
            raise ValueError(f"target must be a finite number, got {target}")
        if time_budget_s is not None and not time_budget_s > 0:
            raise ValueError(f"time_budget_s must be > 0 or None, got {time_budget_s}")
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        if stop_on not in ("first", "stable"):
            raise ValueError(f"stop_on must be 'first' or 'stable', got {stop_on!r}")
        super().__init__()
        self.target, self.metric_name, self.time_budget_s = float(target), metric_name, time_budget_s
        self.start_time, self.mode, self.stop_on = start_time, mode, stop_on
        self.logger = logger or logging.getLogger("monai_fast.handlers")
        self.history: list[tuple[float, int, float]] = []
        self.reached_s: float | None = None  # elapsed seconds when the target was first met
        self.reached_epoch: int | None = None  # the epoch of the weights that met it
        self.stable_s: float | None = None  # elapsed seconds when two readings in a row had met it
        self.stable_epoch: int | None = None
        self.budget_exhausted = False
        self._lock = threading.Lock()
        self._trainer: Engine | None = None
        self._evaluator: Engine | None = None
        self._pending_evaluator: Engine | None = None

    def elapsed(self) -> float:
        """Seconds since the clock started."""
        return time.perf_counter() - (self.start_time if self.start_time is not None else time.perf_counter())

    def state_dict(self) -> dict:
        """The readings, the target's moments and the clock, for a checkpoint: a resumed run goes on with them."""
        return {
            "history": [list(h) for h in self.history],
            "reached": [self.reached_s, self.reached_epoch],
            "stable": [self.stable_s, self.stable_epoch],
            "elapsed_s": self.elapsed(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; the clock goes on from the seconds it had counted (the time between is not)."""
        self.history = [(float(t), int(e), float(v)) for t, e, v in state["history"]]
        self.reached_s, self.reached_epoch = state["reached"]
        self.stable_s, self.stable_epoch = state["stable"]
        self.start_time = time.perf_counter() - float(state["elapsed_s"])

    @property
    def best(self) -> float | None:
        """Best metric value seen so far."""
        return (max if self.mode == "max" else min)((v for _, _, v in self.history), default=None)

    def attach(self, trainer: Engine, evaluator: Engine | None = None) -> None:
        """Watch ``evaluator``'s metric (or ``trainer``'s, without one) and stop ``trainer``."""
        self._pending_evaluator = evaluator
        super().attach(trainer)

    def _attach(self, trainer: Engine) -> None:
        evaluator, self._pending_evaluator = self._pending_evaluator, None
        self._trainer, self._evaluator = trainer, evaluator
        if self.start_time is None:
            self.start_time = time.perf_counter()
        if evaluator is not None:
            self.on(evaluator, Events.COMPLETED, self._check, owner=trainer)
        else:
            self.on(trainer, Events.EPOCH_COMPLETED, self._check)
        if self.time_budget_s is not None:
            self.on(trainer, Events.ITERATION_COMPLETED, self._check_budget)
            if evaluator is not None:
                self.on(evaluator, Events.ITERATION_COMPLETED, self._check_budget, owner=trainer)

    def _metric(self, engine: Engine) -> float:
        name = self.metric_name or getattr(engine.state, "key_metric_name", None)
        if name is None or name not in engine.state.metrics:
            raise KeyError(
                f"TimeToTarget: metric {name!r} not in engine.state.metrics {sorted(engine.state.metrics)}; "
                "pass metric_name="
            )
        return float(engine.state.metrics[name])

    def met(self, value: float) -> bool:
        """Whether ``value`` is at (or past) the target."""
        return value >= self.target if self.mode == "max" else value <= self.target

    def _check(self, engine: Engine) -> None:
        if self.budget_exhausted:  # a terminated evaluator still fires COMPLETED, with no fresh metric
            return
        value = self._metric(engine)
        assert self._trainer is not None
        epoch = engine.state.epoch if isinstance(engine, Evaluator) else self._trainer.state.epoch
        with self._lock:
            elapsed = self.elapsed()
            previous_met = bool(self.history) and self.met(self.history[-1][2])
            self.history.append((elapsed, epoch, value))
            if not self.met(value):
                return
            if self.reached_s is None:
                self.reached_s, self.reached_epoch = elapsed, epoch
                self.logger.info("target %.3f reached: %.4f at %.1f s, epoch %d", self.target, value, elapsed, epoch)
            if previous_met and self.stable_s is None:
                self.stable_s, self.stable_epoch = elapsed, epoch
                self.logger.info("target %.3f stable: %.4f at %.1f s, epoch %d", self.target, value, elapsed, epoch)
            if self.stop_on == "first" or self.stable_s is not None:
                self._trainer.terminate()

    def _check_budget(self, engine: Engine) -> None:
        if self.budget_exhausted or self.reached_s is not None:
            return
        if self.elapsed() > self.time_budget_s:  # type: ignore[operator]
            self.budget_exhausted = True
            self.logger.info("time budget of %.0f s spent; stopping", self.time_budget_s)
            if self._evaluator is not None:
                self._evaluator.terminate()
            assert self._trainer is not None
            self._trainer.terminate()
