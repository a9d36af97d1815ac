"""Samples/s and voxels/s per iteration and epoch, with an ETA."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ignite.engine import Engine, Events

from monai_fast.handlers.record import record_of

__all__ = ["ThroughputMonitor", "batch_shape"]

logger = logging.getLogger("monai_fast.handlers")


def batch_shape(batch: Any) -> tuple[int, ...] | None:
    """Shape of the input tensor of a batch: ``batch["image"]``, else the first tensor found."""
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
    for item in items:
        shape = batch_shape(item)
        if shape is not None:
            return shape
    return None


class ThroughputMonitor:
    """Measures samples/s and voxels/s (samples x spatial voxels of the input) and estimates the ETA.

    Per iteration the values are kept in :attr:`last` (and the run record, if the engine has one);
    per epoch they are logged, written to the record and, with ``writer``, to TensorBoard
    (``throughput/samples_per_s``, ``throughput/voxels_per_s``, ``throughput/eta_s``). The ETA is
    the remaining iterations of the run times the mean iteration time of the last epoch.

    Args:
        shape_fn: batch -> input shape ``(N, C, *spatial)``; default :func:`batch_shape`.
        writer: a TensorBoard ``SummaryWriter``.
        log_every_epoch: log a line per epoch.

    Example:
        >>> from monai_fast.handlers import ThroughputMonitor
        >>> tp = ThroughputMonitor()
        >>> tp.attach(trainer)  # doctest: +SKIP
        >>> trainer.run(); tp.epochs[-1]["samples_per_s"]  # doctest: +SKIP
        14.2
    """

    def __init__(
        self,
        shape_fn: Callable[[Any], tuple[int, ...] | None] = batch_shape,
        writer: Any = None,
        log_every_epoch: bool = True,
    ) -> None:
        if not callable(shape_fn):
            raise TypeError("shape_fn must be callable")
        self.shape_fn = shape_fn
        self.writer = writer
        self.log_every_epoch = log_every_epoch
        self.last: dict[str, float] = {}
        self.epochs: list[dict[str, float]] = []
        self._engine: Engine | None = None

    def attach(self, engine: Engine) -> None:
        """Raises ``RuntimeError`` if already attached."""
        if self._engine is not None:
            raise RuntimeError("ThroughputMonitor is already attached; make one per engine")
        self._engine = engine
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)

    def _epoch_started(self, engine: Engine) -> None:
        self._t_epoch = time.perf_counter()
        self._t_prev = self._t_epoch
        self._samples = 0
        self._voxels = 0

    def _iteration_completed(self, engine: Engine) -> None:
        # an iteration's time runs from the previous one's end, so it includes the data wait
        now = time.perf_counter()
        dt, self._t_prev = now - self._t_prev, now
        shape = self.shape_fn(engine.state.batch)
        n = shape[0] if shape else 0
        vox = n * math.prod(shape[2:]) if shape and len(shape) > 2 else 0
        self._samples += n
        self._voxels += vox
        self.last = {"iteration_s": dt, "samples_per_s": n / dt if dt > 0 else 0.0, "voxels_per_s": vox / dt if dt > 0 else 0.0}
        record = record_of(engine)
        if record is not None:
            record.add("iteration", "throughput", epoch=engine.state.epoch, iteration=engine.state.iteration, samples=n, **self.last)

    def _epoch_completed(self, engine: Engine) -> None:
        elapsed = time.perf_counter() - self._t_epoch
        iters = engine.state.epoch_length or 0
        total_iters = (engine.state.max_epochs or 0) * iters
        remaining = max(total_iters - engine.state.iteration, 0)
        per_iter = elapsed / iters if iters else 0.0
        stats = {
            "epoch": engine.state.epoch,
            "epoch_s": elapsed,
            "samples": self._samples,
            "samples_per_s": self._samples / elapsed if elapsed > 0 else 0.0,
            "voxels_per_s": self._voxels / elapsed if elapsed > 0 else 0.0,
            "eta_s": remaining * per_iter,
        }
        self.epochs.append(stats)
        record = record_of(engine)
        if record is not None:
            record.add("epoch", "throughput", **stats)
            record.set_summary("throughput", {
                "samples_per_s_mean": sum(e["samples_per_s"] for e in self.epochs) / len(self.epochs),
                "voxels_per_s_mean": sum(e["voxels_per_s"] for e in self.epochs) / len(self.epochs),
            })
        if self.writer is not None:
            for k in ("samples_per_s", "voxels_per_s", "eta_s", "epoch_s"):
                self.writer.add_scalar(f"throughput/{k}", stats[k], engine.state.epoch)
        if self.log_every_epoch:
            logger.info(
                "epoch %d: %.1f samples/s, %.3g voxels/s, %.1f s, ETA %.0f s",
                stats["epoch"], stats["samples_per_s"], stats["voxels_per_s"], elapsed, stats["eta_s"],
            )
