"""Samples/s and voxels/s per iteration and epoch, with an ETA."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ignite.engine import Engine, Events

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.record import add_iteration_row, record_of
from monai_fast.telemetry.record import Kind, Source

__all__ = ["ThroughputMonitor", "batch_shape"]

logger = logging.getLogger("monai_fast.handlers")


def batch_shape(batch: Any) -> tuple[int, ...] | None:
    """Shape of the input tensor of a batch: ``batch["image"]``, else the first of the tensors found with the most
    dimensions (an item's id or class is not the input).

    A batch MONAI's engines decollated (a list of one dict per sample) is ``(len(batch), *sample_shape)``.
    """
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(b, dict) for b in batch):
        sample = batch_shape(batch[0])
        return (len(batch), *sample) if sample is not None else None
    if hasattr(batch, "shape"):
        return tuple(batch.shape)
    if isinstance(batch, dict):
        if "image" in batch and hasattr(batch["image"], "shape"):
            return tuple(batch["image"].shape)
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    shapes = [shape for shape in map(batch_shape, items) if shape is not None]
    return max(shapes, key=len, default=None)


class ThroughputMonitor(EngineHandler):
    """Measures samples/s and voxels/s (samples x spatial voxels of the input) and estimates the ETA.

    Validation never counts as training time; epoch-end work is ``epoch_end_s`` and is in the ETA
    (docs/monitoring.md).

    Args:
        shape_fn: batch -> input shape ``(N, C, *spatial)``; default `batch_shape()`.
        writer: a TensorBoard ``SummaryWriter``.
        log_every_epoch: log a line per epoch.

    Examples:
        >>> ThroughputMonitor().attach(trainer)  # doctest: +SKIP
    """

    def __init__(
        self,
        shape_fn: Callable[[Any], tuple[int, ...] | None] = batch_shape,
        writer: Any = None,
        log_every_epoch: bool = True,
    ) -> None:
        if not callable(shape_fn):
            raise TypeError("shape_fn must be callable")
        super().__init__()
        self.shape_fn, self.writer, self.log_every_epoch = shape_fn, writer, log_every_epoch
        self.last: dict[str, float] = {}
        self.epochs: list[dict[str, float]] = []
        self.epoch_ends: list[float] = []
        self._t_last_iter: float | None = None
        self._pending: tuple[dict[str, float], int] | None = None  # an epoch's line, until its end work is measured

    def _attach(self, engine: Engine) -> None:
        self.on(engine, Events.STARTED, self._started)
        self.on(engine, Events.EPOCH_STARTED, self._epoch_started)
        self.on(engine, Events.ITERATION_COMPLETED, self._iteration_completed)
        self.on(engine, Events.EPOCH_COMPLETED, self._epoch_completed)
        self.on_run_end(engine, self._run_ended)

    def _started(self, engine: Engine) -> None:
        self._t_last_iter = None  # a new run: the gap since the last one is not an epoch end

    def _epoch_started(self, engine: Engine) -> None:
        self._t_epoch = time.perf_counter()
        if self._t_last_iter is not None:
            self.epoch_ends.append(self._t_epoch - self._t_last_iter)
        self._t_prev = self._t_last_iter = self._t_epoch
        self._log_pending(self.epoch_ends)
        self._samples = self._voxels = 0

    def _iteration_completed(self, engine: Engine) -> None:
        # an iteration's time runs from the previous one's end, so it includes the data wait
        now = time.perf_counter()
        dt, self._t_prev, self._t_last_iter = now - self._t_prev, now, now
        shape = self.shape_fn(engine.state.batch)
        n = shape[0] if shape else 0
        vox = n * math.prod(shape[2:]) if shape and len(shape) > 2 else 0
        self._samples += n
        self._voxels += vox
        self.last = {
            "iteration_s": dt,
            "samples_per_s": n / dt if dt > 0 else 0.0,
            "voxels_per_s": vox / dt if dt > 0 else 0.0,
        }
        add_iteration_row(engine, Source.THROUGHPUT, samples=n, **self.last)

    def _epoch_completed(self, engine: Engine) -> None:
        elapsed = (self._t_last_iter or self._t_epoch) - self._t_epoch
        iters, max_epochs = engine.state.epoch_length or 0, engine.state.max_epochs or 0
        eta_train = max(max_epochs * iters - engine.state.iteration, 0) * (elapsed / iters if iters else 0.0)
        epochs_left = max(max_epochs - engine.state.epoch, 0)
        eta_end = epochs_left * (sum(self.epoch_ends) / len(self.epoch_ends) if self.epoch_ends else 0.0)
        stats = {
            "epoch": engine.state.epoch,
            "epoch_s": elapsed,
            "samples": self._samples,
            "samples_per_s": self._samples / elapsed if elapsed > 0 else 0.0,
            "voxels_per_s": self._voxels / elapsed if elapsed > 0 else 0.0,
            "epoch_end_s": self.epoch_ends[-1] if self.epoch_ends else 0.0,
            "eta_train_s": eta_train,
            "eta_end_s": eta_end,
            "eta_s": eta_train + eta_end,
        }
        self.epochs.append(stats)
        if (record := record_of(engine)) is not None:
            record.add(Kind.EPOCH, Source.THROUGHPUT, **stats)
            rates = ("samples_per_s", "voxels_per_s")
            means = {f"{k}_mean": sum(e[k] for e in self.epochs) / len(self.epochs) for k in rates}
            record.set_summary(Source.THROUGHPUT, means)
        if self.writer is not None:
            for k in ("samples_per_s", "voxels_per_s", "eta_s", "epoch_s"):
                self.writer.add_scalar(f"throughput/{k}", stats[k], engine.state.epoch)
        if self.log_every_epoch:  # said once this epoch's end work (validation) is over and measured
            self._pending = (stats, epochs_left)

    def _log_pending(self, ends: list[float]) -> None:
        """Log the last epoch's line, its ETA counting the epoch-end work measured so far (the last its own)."""
        if self._pending is None or not ends:
            return
        (stats, left), self._pending = self._pending, None
        eta_end = left * sum(ends) / len(ends)
        logger.info(
            "epoch %d: %.1f samples/s, %.3g voxels/s, %.1f s, %.1f s of epoch-end work (validation, handlers); "
            "ETA %.0f s (%.0f s of it epoch-end work)",
            stats["epoch"],
            stats["samples_per_s"],
            stats["voxels_per_s"],
            stats["epoch_s"],
            ends[-1],
            stats["eta_train_s"] + eta_end,
            eta_end,
        )

    def _run_ended(self, engine: Engine) -> None:
        if self._t_last_iter is not None:
            self._log_pending([*self.epoch_ends, time.perf_counter() - self._t_last_iter])
