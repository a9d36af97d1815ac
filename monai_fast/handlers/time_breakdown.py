"""Data-wait versus compute time per iteration and per epoch, for any ignite ``Engine``."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Literal

from ignite.engine import Engine, Events

from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.record import add_iteration_row, add_row, cached_dataset, loader_of, record_of
from monai_fast.telemetry import cuda_available, synchronize
from monai_fast.telemetry.chain import crop_indices_advised, transform_names
from monai_fast.telemetry.record import Kind, Lever, Source, data_share

__all__ = ["EpochTimes", "TimeBreakdown"]


@dataclass
class EpochTimes:
    """Totals of one epoch, in seconds."""

    epoch: int
    iterations: int
    data_s: float
    compute_s: float

    @property
    def data_share(self) -> float:
        """Share of iteration time spent waiting for the loader (0 when nothing was timed)."""
        return data_share(self.data_s, self.compute_s)

    def as_dict(self) -> dict:
        return {**asdict(self), "data_share": self.data_share}


class TimeBreakdown(EngineHandler):
    """Splits each iteration into time waiting for data and time computing on it.

    Per-epoch `EpochTimes` go to ``engine.state.time_breakdown``, `epochs` and the run record; a
    loader-bound epoch logs a warning naming the fix (docs/monitoring.md).

    Args:
        warn_threshold: data share (0..1] above which an epoch is reported as loader-bound.
        cuda_sync: synchronise CUDA before each reading: ``True``, ``"auto"`` (on a CUDA engine device) or
            ``False``; ``True`` without CUDA warns and acts as ``False``.
        logger: where warnings and per-epoch summaries go; default ``monai_fast.handlers``.

    Examples:
        >>> TimeBreakdown(warn_threshold=0.3).attach(trainer)  # doctest: +SKIP
    """

    def __init__(
        self,
        warn_threshold: float = 0.2,
        cuda_sync: bool | Literal["auto"] = "auto",
        logger: logging.Logger | None = None,
    ) -> None:
        if not 0.0 < warn_threshold <= 1.0:
            raise ValueError(f"warn_threshold must be in (0, 1], got {warn_threshold}")
        if cuda_sync not in (True, False, "auto"):
            raise ValueError(f"cuda_sync must be True, False or 'auto', got {cuda_sync!r}")
        super().__init__()
        self.warn_threshold, self.cuda_sync = warn_threshold, cuda_sync
        self.logger = logger or logging.getLogger("monai_fast.handlers")
        self.epochs: list[EpochTimes] = []
        self.last_data_s = self.last_compute_s = 0.0
        self._sync_device = None
        self._t_get = self._t_got = self._data_s = self._compute_s = 0.0
        self._iters = 0

    def _attach(self, engine: Engine) -> None:
        device = getattr(engine.state, "device", None)  # set by MONAI workflows; None on a plain Engine
        if self.cuda_sync is True and not cuda_available():
            self.logger.warning("TimeBreakdown: cuda_sync=True but CUDA is not available; timing without sync")
        elif self.cuda_sync is True or (
            self.cuda_sync == "auto" and device is not None and str(device).startswith("cuda")
        ):
            self._sync_device = device if device is not None else "cuda"
        engine.state.time_breakdown = []
        self.on(engine, Events.STARTED, self._run_started)
        self.on(engine, Events.EPOCH_STARTED, self._epoch_started)
        self.on(engine, Events.GET_BATCH_STARTED, self._batch_started)
        self.on(engine, Events.GET_BATCH_COMPLETED, self._batch_completed)
        self.on(engine, Events.ITERATION_COMPLETED, self._iteration_completed)
        self.on(engine, Events.EPOCH_COMPLETED, self._epoch_completed)

    def _now(self) -> float:
        if self._sync_device is not None:
            synchronize(self._sync_device)
        return time.perf_counter()

    def _run_started(self, engine: Engine) -> None:
        # each run's own epochs: a run started again (a notebook cell, more epochs) does not count the last one's
        engine.state.time_breakdown = []

    def _epoch_started(self, engine: Engine) -> None:
        self._data_s = self._compute_s = 0.0
        self._iters = 0

    def _batch_started(self, engine: Engine) -> None:
        self._t_get = self._now()

    def _batch_completed(self, engine: Engine) -> None:
        self._t_got = time.perf_counter()
        self.last_data_s = self._t_got - self._t_get
        self._data_s += self.last_data_s

    def _iteration_completed(self, engine: Engine) -> None:
        self.last_compute_s = self._now() - self._t_got
        self._compute_s += self.last_compute_s
        self._iters += 1
        add_iteration_row(engine, Source.TIME_BREAKDOWN, data_s=self.last_data_s, compute_s=self.last_compute_s)

    @staticmethod
    def _fix(engine: Engine) -> str:
        """The fix for a loader-bound epoch: caching, or, where the data are cached already, the rest."""
        record = record_of(engine)
        lever = record.lever(Source.FAST_TRAINING, Lever.DATA) if record is not None else None
        if lever is not None and lever.get("applied"):
            cached = f"FastTraining cached them ({lever.get('setting')})"
        elif (name := cached_dataset(engine)) is not None:
            cached = f"the loader reads a {name}"
        else:
            return "cache deterministic transforms (CacheDataset / GPU cache) or use ThreadDataLoader"
        names = transform_names(getattr(getattr(loader_of(engine), "dataset", None), "transform", None))
        if crop_indices_advised(names):  # the chain crops by label without precomputed indices
            more = ", load with more threads, or precompute crop indices (FgBgToIndicesd)"
        else:
            more = " or load with more threads"
        return (
            f"the deterministic transforms are cached ({cached}): run the random transforms on the device "
            f"(ToDeviced before them){more}"
        )

    def _epoch_completed(self, engine: Engine) -> None:
        times = EpochTimes(engine.state.epoch, self._iters, self._data_s, self._compute_s)
        self.epochs.append(times)
        if not hasattr(engine.state, "time_breakdown"):  # state was replaced, e.g. by load_state_dict
            engine.state.time_breakdown = []
        engine.state.time_breakdown.append(times)
        add_row(engine, Kind.EPOCH, Source.TIME_BREAKDOWN, **times.as_dict())
        if times.data_share > self.warn_threshold:
            self.logger.warning(
                "epoch %d: %.0f%% of iteration time is spent waiting for data (%.2f s of %.2f s); %s",
                times.epoch,
                100 * times.data_share,
                times.data_s,
                times.data_s + times.compute_s,
                self._fix(engine),
            )
