"""Stop training when a validation metric reaches a target, or when a wall-clock budget is spent."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Literal

from ignite.engine import Engine, Events
from monai.engines import Evaluator

from monai_fast.handlers.lifecycle import EngineHandler

__all__ = ["TimeToTarget"]


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
