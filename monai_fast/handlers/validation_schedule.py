"""Run the full validation only when a cheap estimate says the target is near."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable
from typing import Literal

from ignite.engine import Engine, Events
from ignite.metrics import Metric
from monai.engines import Evaluator, SupervisedEvaluator
from monai.inferers import Inferer

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.record import add_row
from monai_fast.telemetry.record import Kind, Source

__all__ = ["ValidationSchedule", "estimator_like"]


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
