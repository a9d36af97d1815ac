"""Train one recipe until a target validation Dice or a time budget, with its telemetry, and record every epoch."""

from __future__ import annotations

import csv
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from ignite.engine import Engine, Events
from ignite.handlers import ProgressBar
from monai.handlers import TensorBoardStatsHandler, from_engine

from monai_fast.apps.recipes import VAL_METRIC, Recipe, RecipeConfig, build_recipe
from monai_fast.data.rng_state import OwnRandomStream
from monai_fast.extras import available, require
from monai_fast.files import atomic_write
from monai_fast.handlers import (
    GPUSampler,
    InferenceSplit,
    MainThreadCore,
    NVTXHandler,
    RecordHandler,
    ThroughputMonitor,
    TimeBreakdown,
    TimeToTarget,
    ValidationSchedule,
)
from monai_fast.handlers.lifecycle import handlers_on
from monai_fast.handlers.preemption import end_of_setup, stop_signals_caught
from monai_fast.handlers.record import record_of
from monai_fast.handlers.throughput import batch_shape
from monai_fast.progress import show_progress
from monai_fast.telemetry import device_description
from monai_fast.telemetry.host import process_tree_cpu_seconds
from monai_fast.telemetry.record import Category, Source, data_share, wall_time

if TYPE_CHECKING:  # tensorboard is the [plots] extra, imported where a run writes its events
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["EPOCH_FIELDS", "EpochRecorder", "EpochRow", "TargetRun", "TrainResult", "run_to_target", "write_epochs_csv"]

logger = logging.getLogger(__name__)


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
        self._started: tuple[int, float, float] = (0, 0.0, 0.0)  # the epoch, its start's elapsed and CPU seconds
        self._resumed: list | None = None  # `_started` as a checkpoint held it, until the run resumes

    def attach(self, trainer: Engine, evaluator: Engine) -> None:
        trainer.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)
        evaluator.add_event_handler(Events.ITERATION_COMPLETED, self._val_iteration_completed)
        evaluator.add_event_handler(Events.COMPLETED, self._val_completed)

    def state_dict(self) -> dict:
        """The epochs recorded and the one under way, for a checkpoint: a resumed run's rows go on from them."""
        partial = [self._loss_sum, self._n, self._samples, self._volumes, self._val_s, self._val_dice]
        epoch, elapsed, cpu = self._started
        return {
            "rows": [asdict(r) for r in self.rows],
            "partial": partial,
            "started": [epoch, elapsed, process_tree_cpu_seconds() - cpu],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`: the epoch under way at the checkpoint goes on (its counts, seconds and CPU seconds)
        where the run resumes in it."""
        self.rows = [EpochRow(**row) for row in state["rows"]]
        self._loss_sum, self._n, self._samples, self._volumes, self._val_s, self._val_dice = state["partial"]
        self._resumed = state["started"]

    def _epoch_started(self, engine: Engine) -> None:
        resumed, self._resumed = self._resumed, None
        if resumed is not None and resumed[0] == engine.state.epoch:  # the checkpoint's epoch, resumed: it goes on
            self._started = (engine.state.epoch, float(resumed[1]), process_tree_cpu_seconds() - float(resumed[2]))
            return
        self._loss_sum, self._n, self._val_s, self._val_dice = 0.0, 0, 0.0, None
        self._samples, self._volumes = 0, 0
        self._started = (engine.state.epoch, self.stopper.elapsed(), process_tree_cpu_seconds())

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
            wall_s=self.stopper.elapsed() - self._started[1],
            cpu_s=process_tree_cpu_seconds() - self._started[2],
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


@dataclass
class TrainResult:
    """Outcome of `run_to_target()` for one recipe."""

    recipe: str
    target: float
    reached: bool
    time_to_target_s: float | None
    epochs_to_target: int | None
    epochs_run: int
    best_dice: float | None
    setup_s: float
    total_s: float
    train_s_per_epoch: float
    val_s_per_epoch: float
    data_wait_share: float
    time_budget_s: float | None
    budget_exhausted: bool
    device: str
    amp: bool
    run_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    epochs: list[EpochRow] = field(default_factory=list)
    diagnosis: dict | None = None
    setup_cpu_s: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def run_to_target(
    recipe: str,
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    *args: Any,
    **kwargs: Any,
) -> TrainResult:
    """Build ``recipe`` and train it until validation mean Dice >= ``target`` or the budget is spent.

    A `TargetRun` (arguments as its own) run to its end in one segment.

    Example:
        >>> result = run_to_target("fast", train_files, val_files, device="cpu", time_budget_s=60)  # doctest: +SKIP
    """
    run = TargetRun(recipe, train_files, val_files, config, *args, **kwargs)
    run.segment(epochs=None)
    return run.finish()


class TargetRun:
    """One recipe trained towards a target in segments, on a clock that runs only while it trains (docs/recipes.md).

    The clock starts before the data sets are built (caching counts) and stops between segments; each run
    draws from its own copy of the global random generators (`OwnRandomStream`).

    Args:
        recipe: one of `monai_fast.apps.recipes.RECIPES`.
        train_files, val_files: ``{"image", "label"}`` dicts, e.g. from `load_msd_datalist()`.
        config, device: recipe options; ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        target: validation mean Dice (background excluded) to reach.
        time_budget_s: wall-clock limit in seconds; ``None``: ``config.max_epochs`` is the only limit.
        run_dir: if given, ``run_dir/<recipe>/`` receives TensorBoard events, ``epochs.csv`` and the run record.
        progress: a progress bar per epoch where one fits, else a log line per epoch.

    Example:
        >>> run = TargetRun("baseline", train_files, val_files, device="cpu", time_budget_s=600)  # doctest: +SKIP
        >>> run.segment(epochs=1); result = run.finish()  # doctest: +SKIP
    """

    def __init__(
        self,
        recipe: str,
        train_files: Sequence[dict],
        val_files: Sequence[dict],
        config: RecipeConfig | None = None,
        device: str | torch.device = "cpu",
        target: float = 0.9,
        time_budget_s: float | None = 300.0,
        run_dir: str | os.PathLike | None = None,
        progress: bool = True,
    ) -> None:
        t0, cpu0 = time.perf_counter(), process_tree_cpu_seconds()
        self.recipe, self.target = recipe, target
        config = replace(config or RecipeConfig(), val_target=target)  # a validation schedule aims at the run's target
        with stop_signals_caught():
            self.built = build_recipe(recipe, train_files, val_files, config, device, progress=progress)
        self.setup_cpu_s = process_tree_cpu_seconds() - cpu0  # building the data sets and caches, in CPU seconds
        self.random = OwnRandomStream()  # its own draws, however the turns of a race fall
        trainer, evaluator = self.built.trainer, self.built.evaluator
        self.out = Path(run_dir) / recipe if run_dir is not None else None
        self.writer = _attach_telemetry(self.built, self.out, t0)
        self.breakdown = TimeBreakdown()
        self.breakdown.attach(trainer)
        own_log = logging.getLogger(f"{__name__}.{recipe}")  # lines that name the recipe
        self.stopper = TimeToTarget(target, VAL_METRIC, time_budget_s=time_budget_s, start_time=t0, logger=own_log)
        self.stopper.attach(trainer, evaluator)
        if self.built.fast_training is not None:  # a compile must pay back within this recipe's budget
            self.built.fast_training.time_limit_s = self._seconds_left
        bars = show_progress(progress)
        self.recorder = EpochRecorder(recipe, self.stopper, self.breakdown, self.writer, log_epochs=not bars)
        self.recorder.attach(trainer, evaluator)
        if bars:
            loss_of, seen = from_engine(["loss"], first=True), self.stopper
            shown = lambda out: {"loss": loss_of(out), "last val Dice": seen.history[-1][2] if seen.history else 0.0}
            ProgressBar(persist=False, desc=f"{recipe}").attach(trainer, output_transform=shown)
        self._segment_end = 0
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._maybe_pause)
        trainer.add_event_handler(Events.STARTED, self._record_pause)
        self._pause: tuple[float, float] | None = None
        logger.info("%s: set up in %.1f s", recipe, self.built.setup_s)
        for note in self.built.notes:  # a line each: one line of them all runs to thousands of characters
            logger.info("%s: %s", recipe, note)
        self._paused_at = time.perf_counter()
        self._finished: TrainResult | None = None

    @property
    def time_budget_s(self) -> float | None:
        """Seconds this recipe's clock may run; settable between segments (a budget set later than at start)."""
        return self.stopper.time_budget_s

    @time_budget_s.setter
    def time_budget_s(self, seconds: float) -> None:
        if self.stopper.time_budget_s is None:
            raise ValueError(f"{self.recipe}: a run started with no budget cannot be given one later")
        self.stopper.time_budget_s = float(seconds)

    def elapsed(self) -> float:
        """Seconds on this recipe's clock (setup and its own segments only)."""
        now = self._paused_at if self._paused_at is not None else time.perf_counter()
        return now - (self.stopper.start_time or 0.0)

    def _seconds_left(self) -> float | None:
        budget = self.time_budget_s
        return None if budget is None or math.isinf(budget) else budget - self.elapsed()

    @property
    def done(self) -> bool:
        """Target reached, budget spent, or the epoch limit hit."""
        state = self.built.trainer.state
        max_epochs = state.max_epochs or self.built.config.max_epochs
        over = self.time_budget_s is not None and self.elapsed() > self.time_budget_s
        return self.stopper.reached_s is not None or self.stopper.budget_exhausted or over or state.epoch >= max_epochs

    def segment(self, epochs: int | None = 1) -> None:
        """Train ``epochs`` more epochs (``None``: to the end), the clock running only meanwhile; ends the set-up.

        Raises:
            SystemExit: 143, when a stop signal arrived during the set-up and no ``Preemption`` took it over.
        """
        end_of_setup()  # training starts: a signal kept since the program's start stops it here, saying so
        if self.done:
            return
        assert self._paused_at is not None
        self._pause = (wall_time(self._paused_at), time.time())  # recorded once the run has reopened its record
        self.stopper.start_time = (self.stopper.start_time or 0.0) + time.perf_counter() - self._paused_at
        self._paused_at = None
        self._segment_end = 0 if epochs is None else self.built.trainer.state.epoch + epochs
        try:
            with self.random:
                self.built.trainer.run()
        finally:
            self._paused_at = time.perf_counter()

    def _record_pause(self, engine: Engine) -> None:
        """The time since its last segment as a ``paused`` span, which the doctor gives no advice on."""
        record = record_of(engine)
        if self._pause is not None and record is not None:
            record.add_span(Category.PAUSED, *self._pause, source=Source.RECIPE)
        self._pause = None

    def _maybe_pause(self, engine: Engine) -> None:
        if self._segment_end and engine.state.epoch >= self._segment_end:
            engine.terminate()

    def finish(self) -> TrainResult:
        """Close the TensorBoard writer, write ``epochs.csv`` and return the `TrainResult` (once).

        The result is kept before ``epochs.csv`` is written: after a failed write a second call still returns it.
        """
        if self._finished is None:
            if self.writer is not None:
                self.writer.close()
            rows, stopper = self.recorder.rows, self.stopper
            val_rows = [r for r in rows if r.val_dice is not None]
            self._finished = TrainResult(
                recipe=self.recipe,
                target=self.target,
                reached=stopper.reached_s is not None,
                time_to_target_s=stopper.reached_s,
                epochs_to_target=stopper.reached_epoch,
                epochs_run=len(rows),
                best_dice=stopper.best,
                setup_s=self.built.setup_s,
                total_s=self.elapsed(),
                train_s_per_epoch=sum(r.train_s for r in rows) / max(len(rows), 1),
                val_s_per_epoch=sum(r.val_s for r in val_rows) / max(len(val_rows), 1),
                data_wait_share=data_share(sum(r.data_wait_s for r in rows), sum(r.compute_s for r in rows)),
                time_budget_s=self.time_budget_s,
                budget_exhausted=stopper.budget_exhausted,
                device=device_description(self.built.device),
                amp=self.built.amp,
                run_dir=None if self.out is None else str(self.out),
                notes=self.built.notes,
                epochs=rows,
                setup_cpu_s=self.setup_cpu_s,
            )
            if self.out is not None:
                write_epochs_csv(self.recorder.rows, self.out / "epochs.csv")
        return self._finished


def loss_writer(folder: Path, trainer: Engine, feature: str) -> SummaryWriter:
    """A TensorBoard writer into ``folder`` (made) and MONAI's loss-per-iteration handler on ``trainer``.

    Raises:
        monai_fast.extras.MissingExtraError: tensorboard is not installed (``feature`` named).
    """
    tensorboard = require("torch.utils.tensorboard", extra="plots", feature=feature)
    folder.mkdir(parents=True, exist_ok=True)
    writer = tensorboard.SummaryWriter(log_dir=str(folder))
    loss = from_engine(["loss"], first=True)
    TensorBoardStatsHandler(summary_writer=writer, tag_name="train/loss", output_transform=loss).attach(trainer)
    return writer


def _attach_telemetry(built: Recipe, out: Path | None, t0: float) -> SummaryWriter | None:
    """TensorBoard, the run record (its set-up span from ``t0``), NVTX, GPU sampler and throughput on the engines."""
    trainer, evaluator = built.trainer, built.evaluator
    writer = None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if available("tensorboard"):  # a by-product of the run: without the extra it is skipped, not fatal
            writer = loss_writer(out, trainer, "a run's TensorBoard events")
        else:
            logger.warning(
                "the run's TensorBoard events are skipped: they need tensorboard, which is not installed: "
                'pip install "monai-fast[plots]"'
            )
        record = RecordHandler(out)  # the run record the doctor reads, shared by trainer and evaluator
        record.attach(trainer)
        record.attach(evaluator)
        record.record.add_span(Category.SETUP, wall_time(t0), wall_time(t0 + built.setup_s), source=Source.RECIPE)
        InferenceSplit().attach(evaluator)  # after the evaluator's metrics: the doctor's network vs stitching split
    if available("nvtx"):  # ranges for a profiler; the nvidia extra is optional, so they are too
        NVTXHandler().attach(trainer)
        NVTXHandler().attach(evaluator)
    schedule = handlers_on(trainer).get(ValidationSchedule)
    estimator = [schedule.estimator] if isinstance(schedule, ValidationSchedule) else []
    for engine in (trainer, evaluator, *estimator):  # apart from OpenMP's pinned workers (when the command pinned them)
        if MainThreadCore not in handlers_on(engine):  # FastTraining attaches one to the recipes built on it
            MainThreadCore().attach(engine)
    if built.device.type == "cuda":
        GPUSampler(interval_s=0.5, writer=writer).attach(trainer)
    ThroughputMonitor(writer=writer, log_every_epoch=False).attach(trainer)
    return writer
