"""A recipe's epochs as rows: `EpochRow`, the recorder that collects them, and their CSV."""

from __future__ import annotations

import csv
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ignite.engine import Engine, Events
from monai.handlers import from_engine

from monai_fast.apps.recipes import VAL_METRIC
from monai_fast.files import atomic_write
from monai_fast.handlers import TimeBreakdown, TimeToTarget
from monai_fast.handlers.throughput import batch_shape
from monai_fast.telemetry.host import process_tree_cpu_seconds

if TYPE_CHECKING:  # the writer comes from the caller; tensorboard is the [plots] extra
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["EPOCH_FIELDS", "EpochRecorder", "EpochRow", "write_epochs_csv"]

logger = logging.getLogger("monai_fast.apps.training.run")  # its lines are the run's


@dataclass
class EpochRow:
    """One epoch of one recipe; ``elapsed_s`` counts from before the data sets were built.

    ``train_s`` is ignite's epoch time, ``val_s`` the full validation, ``wall_s`` the whole epoch on
    the recipe's clock, ``cpu_s`` this process's and its loader workers' CPU seconds.
    ``train_samples`` (crops) and ``val_volumes`` let recipes compare per crop and per volume, never per epoch.
    """

    recipe: str
    epoch: int
    elapsed_s: float
    train_s: float
    val_s: float
    data_wait_s: float
    compute_s: float
    data_share: float
    loss: float
    val_dice: float | None
    wall_s: float | None = None
    cpu_s: float | None = None
    train_samples: int | None = None
    val_volumes: int | None = None


EPOCH_FIELDS = [f for f in EpochRow.__dataclass_fields__]


def write_epochs_csv(rows: Iterable[EpochRow], path: str | os.PathLike) -> Path:
    """Write ``rows`` as CSV (header `EPOCH_FIELDS`) to ``path`` atomically; returns ``path``."""
    with atomic_write(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=EPOCH_FIELDS)
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    return Path(path)


class EpochRecorder:
    """Collects an `EpochRow` per trainer epoch and mirrors it to TensorBoard."""

    def __init__(
        self,
        recipe_name: str,
        stopper: TimeToTarget,
        breakdown: TimeBreakdown,
        writer: SummaryWriter | None,
        log_epochs: bool = False,
    ):
        self.name, self.stopper, self.breakdown, self.writer = recipe_name, stopper, breakdown, writer
        self.log_epochs = log_epochs
        self.rows: list[EpochRow] = []
        self._loss_sum, self._n, self._val_s = 0.0, 0, 0.0
        self._val_dice: float | None = None
        self._samples, self._volumes = 0, 0

    def attach(self, trainer: Engine, evaluator: Engine) -> None:
        trainer.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)
        evaluator.add_event_handler(Events.ITERATION_COMPLETED, self._val_iteration_completed)
        evaluator.add_event_handler(Events.COMPLETED, self._val_completed)

    def _epoch_started(self, engine: Engine) -> None:
        self._loss_sum, self._n, self._val_s, self._val_dice = 0.0, 0, 0.0, None
        self._samples, self._volumes = 0, 0
        self._started = (self.stopper.elapsed(), process_tree_cpu_seconds())

    def _iteration_completed(self, engine: Engine) -> None:
        # MONAI's trainer has already turned the loss into a Python float (decollated output)
        self._loss_sum += float(from_engine(["loss"], first=True)(engine.state.output))
        self._n += 1
        shape = batch_shape(engine.state.batch)
        self._samples += shape[0] if shape else 0

    def _val_iteration_completed(self, engine: Engine) -> None:
        shape = batch_shape(engine.state.batch)
        self._volumes += shape[0] if shape else 0

    def _val_completed(self, engine: Engine) -> None:
        self._val_s = engine.state.times.get("COMPLETED") or 0.0
        value = engine.state.metrics.get(VAL_METRIC)
        self._val_dice = None if value is None else float(value)

    def _epoch_completed(self, engine: Engine) -> None:
        times = self.breakdown.epochs[-1]
        row = EpochRow(
            recipe=self.name,
            epoch=engine.state.epoch,
            elapsed_s=self.stopper.elapsed(),
            train_s=float(engine.state.times.get("EPOCH_COMPLETED") or 0.0),
            val_s=self._val_s,
            data_wait_s=times.data_s,
            compute_s=times.compute_s,
            data_share=times.data_share,
            loss=float(self._loss_sum / max(self._n, 1)),
            val_dice=self._val_dice,
            wall_s=self.stopper.elapsed() - self._started[0],
            cpu_s=process_tree_cpu_seconds() - self._started[1],
            train_samples=self._samples,
            val_volumes=self._volumes if self._val_dice is not None else 0,
        )
        self.rows.append(row)
        if self.log_epochs:  # where no bar is drawn: one line per epoch
            dice = "" if row.val_dice is None else f", val Dice {row.val_dice:.3f}"
            args = (self.name, row.epoch, row.loss, row.train_s + row.val_s, row.train_s, row.val_s, dice)
            logger.info("%s epoch %d: loss %.4f, %.1f s (train %.1f s, val %.1f s)%s", *args)
        if self.writer is not None:
            wall = time.time()
            for tag, value in (
                ("epoch/loss", row.loss),
                ("epoch/train_s", row.train_s),
                ("epoch/val_s", row.val_s),
                ("epoch/data_share", row.data_share),
                ("val/mean_dice", row.val_dice),
            ):
                if value is not None:
                    self.writer.add_scalar(tag, value, row.epoch, walltime=wall)
            if row.val_dice is not None:
                # x axis in whole seconds since the clock started: Dice against wall-clock time
                self.writer.add_scalar("val/mean_dice_vs_seconds", row.val_dice, int(round(row.elapsed_s)))
            self.writer.flush()
