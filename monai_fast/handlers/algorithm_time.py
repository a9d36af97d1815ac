"""What a trainer's own post-processing and training metrics cost per epoch: the user's algorithm, timed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ignite.engine import Engine, Events
from ignite.metrics import Metric
from monai.engines.utils import IterationEvents

from monai_fast.handlers.lifecycle import POSTPROCESSING, EngineHandler, callbacks_on, posttrans_of
from monai_fast.handlers.record import add_row
from monai_fast.telemetry.chain import transform_names
from monai_fast.telemetry.cuda import Mark, seconds_between, time_mark
from monai_fast.telemetry.record import Kind, Source

__all__ = ["AlgorithmTimes", "TrainingAlgorithmTime"]

# MONAI registers its decollation as a closure of this Workflow method
_DECOLLATE = "_register_decollate.<locals>._decollate_data"


@dataclass
class AlgorithmTimes:
    """Totals of one training epoch, in seconds (what each total covers: docs/monitoring.md)."""

    epoch: int
    iterations: int = 0
    epoch_s: float = 0.0
    postprocessing_s: float = 0.0
    decollate_s: float = 0.0
    metrics_s: float = 0.0
    metrics: list[str] = field(default_factory=list)
    postprocessing: list[str] = field(default_factory=list)

    @property
    def algorithm_s(self) -> float:
        """Post-processing, decollation and metrics together."""
        return self.postprocessing_s + self.decollate_s + self.metrics_s

    def as_dict(self) -> dict:
        return {**asdict(self), "algorithm_s": self.algorithm_s}


def _metric_of(fn: Callable) -> tuple[Metric, str] | None:
    """The ignite ``Metric`` whose ``iteration_completed`` / ``completed`` ``fn`` is, with the method's name."""
    parent = getattr(fn, "_parent", None)
    target = parent() if parent is not None else fn
    owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if isinstance(owner, Metric) and name in ("iteration_completed", "completed"):
        return owner, name
    return None


class TrainingAlgorithmTime(EngineHandler):
    """Times a MONAI trainer's own post-processing and training metrics, per epoch.

    Each epoch's `AlgorithmTimes` goes to `epochs` and the run record. See docs/monitoring.md.

    Args:
        logger: where the per-epoch line (debug level) goes; default ``monai_fast.handlers``.

    Examples:
        >>> timer = TrainingAlgorithmTime()
        >>> timer.attach(trainer)  # doctest: +SKIP
    """

    def __init__(self, logger: logging.Logger | None = None) -> None:
        if logger is not None and not isinstance(logger, logging.Logger):
            raise ValueError(f"logger must be a logging.Logger, got {type(logger).__name__}")
        super().__init__()
        self.logger = logger or logging.getLogger("monai_fast.handlers")
        self.epochs: list[AlgorithmTimes] = []
        self._device = None
        self._metrics: dict[int, str] = {}  # metric id -> its class name
        self._postprocessing: list[str] = []
        self._marks: dict[str, list[tuple[Mark, Mark]]] = {}
        self._start: Mark | None = None
        self._loop_end: Mark | None = None
        self._epoch: AlgorithmTimes | None = None
        self._first_iteration = 0

    def _attach(self, engine: Engine) -> None:
        self._device = getattr(engine.state, "device", None)
        self._wrap_new(engine)
        self.on(engine, Events.STARTED, self._wrap_new)
        self.on(engine, Events.EPOCH_STARTED, self._epoch_started, first=True)
        self.on(engine, Events.EPOCH_COMPLETED, self._loop_ended, first=True)
        self.on_run_end(engine, self._write)

    @property
    def timed(self) -> list[str]:
        """What is timed on the engine: the post-processing's transforms and the metrics' classes."""
        return list(dict.fromkeys(self._postprocessing + list(self._metrics.values())))

    def _wrap_new(self, engine: Engine) -> None:
        """Wrap the post-processing (on MODEL_COMPLETED), decollation and metric callbacks not wrapped yet."""
        for event in (IterationEvents.MODEL_COMPLETED, Events.ITERATION_COMPLETED, Events.EPOCH_COMPLETED):
            for fn in callbacks_on(engine, event):
                if getattr(fn, "_monai_fast_timed", False):
                    continue
                qualname = getattr(fn, "__qualname__", "")
                if qualname.endswith(POSTPROCESSING):
                    part = "postprocessing"
                    names = dict.fromkeys(transform_names(posttrans_of(fn)) or [])
                    self._postprocessing = list(names) or ["postprocessing"]
                elif qualname.endswith(_DECOLLATE):
                    part = "decollate"
                elif (metric := _metric_of(fn)) is not None:
                    part = "metrics_end" if event == Events.EPOCH_COMPLETED else "metrics"
                    self._metrics[id(metric[0])] = type(metric[0]).__name__
                else:
                    continue
                self.wrap(engine, event, fn, self._timer(fn, part))

    def _timer(self, fn: Callable, part: str) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time_mark(self._device)
            try:
                return fn(*args, **kwargs)
            finally:
                self._marks.setdefault(part, []).append((start, time_mark(self._device)))

        timed._monai_fast_timed = True  # type: ignore[attr-defined]
        return timed

    def _epoch_started(self, engine: Engine) -> None:
        self._write(engine)  # the previous epoch, once its metrics' completed has run
        self._marks = {}
        self._loop_end = None
        self._start = time_mark(self._device)
        self._epoch = AlgorithmTimes(engine.state.epoch)
        self._first_iteration = engine.state.iteration

    def _loop_ended(self, engine: Engine) -> None:
        self._loop_end = time_mark(self._device)
        if self._epoch is not None:
            self._epoch.iterations = engine.state.iteration - self._first_iteration

    def _write(self, engine: Engine) -> None:
        """Close the pending epoch: at the next epoch's start, or when the run ends."""
        times, self._epoch = self._epoch, None
        if times is None or self._start is None or self._loop_end is None or not self._marks:
            return
        parts = {part: sum(seconds_between(a, b) for a, b in marks) for part, marks in self._marks.items()}
        times.epoch_s = seconds_between(self._start, self._loop_end) + parts.get("metrics_end", 0.0)
        times.postprocessing_s = parts.get("postprocessing", 0.0)
        times.decollate_s = parts.get("decollate", 0.0)
        times.metrics_s = parts.get("metrics", 0.0) + parts.get("metrics_end", 0.0)
        times.metrics = sorted(set(self._metrics.values()))
        times.postprocessing = list(self._postprocessing)
        self.epochs.append(times)
        add_row(engine, Kind.EPOCH, Source.TRAINING_ALGORITHM, **times.as_dict())
        self.logger.debug(
            "TrainingAlgorithmTime: epoch %d: post-processing %.2f s, decollate %.2f s, metrics %.2f s of %.2f s",
            times.epoch,
            times.postprocessing_s,
            times.decollate_s,
            times.metrics_s,
            times.epoch_s,
        )
