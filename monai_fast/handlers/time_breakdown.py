"""Where an engine's time goes: data wait versus compute (`TimeBreakdown`), a trainer's own post-processing and
metrics (`TrainingAlgorithmTime`), an evaluator's network versus the sliding window around it (`InferenceSplit`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from ignite.engine import Engine, Events
from ignite.metrics import Metric
from monai.engines.utils import IterationEvents

from monai_fast.handlers.lifecycle import POSTPROCESSING, EngineHandler, callbacks_on, posttrans_of
from monai_fast.handlers.record import add_iteration_row, add_row, cached_dataset, loader_of, record_of
from monai_fast.telemetry import cuda_available, synchronize
from monai_fast.telemetry.chain import crop_indices_advised, transform_names
from monai_fast.telemetry.cuda import Mark, seconds_between, time_mark
from monai_fast.telemetry.record import Kind, Lever, Source, data_share

__all__ = [
    "AlgorithmTimes",
    "EpochTimes",
    "InferenceSplit",
    "InferenceTimes",
    "TimeBreakdown",
    "TrainingAlgorithmTime",
]

logger = logging.getLogger("monai_fast.handlers")


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


@dataclass
class InferenceTimes:
    """Totals of one evaluator run (one validation), in seconds (what each total covers: docs/monitoring.md)."""

    iterations: int = 0
    network_calls: int = 0
    windows: int = 0
    network_s: float = 0.0
    sliding_window_s: float = 0.0
    before_s: float = 0.0
    after_s: float = 0.0

    @property
    def iteration_s(self) -> float:
        return self.network_s + self.sliding_window_s + self.before_s + self.after_s

    def as_dict(self) -> dict:
        return {**asdict(self), "iteration_s": self.iteration_s}


class InferenceSplit(EngineHandler):
    """Splits an evaluator's iterations into network time and sliding-window time around it.

    Attach it after the evaluator's metrics; a shared network is timed for validation only.
    See docs/monitoring.md.

    Args:
        network: the module the inferer calls; default the engine's ``network`` (`ValueError` at attach: none).
        logger: where the per-run line (debug level) and warnings go; default ``monai_fast.handlers``.

    Examples:
        >>> split = InferenceSplit()
        >>> split.attach(evaluator)  # doctest: +SKIP
    """

    def __init__(self, network: torch.nn.Module | None = None, logger: logging.Logger | None = None) -> None:
        if network is not None and not isinstance(network, torch.nn.Module):
            raise ValueError(f"network must be a torch.nn.Module, got {type(network).__name__}")
        super().__init__()
        self.network = network
        self.logger = logger or logging.getLogger("monai_fast.handlers")
        self.runs: list[InferenceTimes] = []
        self._hooks: list = []
        self._thread: int | None = None  # the thread whose iteration is timed
        self._device = None
        self._totals = InferenceTimes()
        self._start: Mark | None = None
        self._calls: list[list[Mark]] = []
        self._forward_done: Mark | None = None
        self._warned = False

    def _attach(self, engine: Engine) -> None:
        net = self.network if self.network is not None else getattr(engine, "network", None)
        if not isinstance(net, torch.nn.Module):
            raise ValueError(
                "InferenceSplit: the engine has no `network` attribute (not a MONAI evaluator); "
                "pass network=<the module the inferer calls>"
            )
        self._device = getattr(engine.state, "device", None)
        self._hooks = [net.register_forward_pre_hook(self._before_call), net.register_forward_hook(self._after_call)]
        self.on(engine, Events.EPOCH_STARTED, self._run_started)
        self.on(engine, Events.ITERATION_STARTED, self._iteration_started)
        # MONAI's engines fire FORWARD_COMPLETED right after the inferer returns; a plain ignite Engine has none
        with contextlib.suppress(ValueError):
            self.on(engine, IterationEvents.FORWARD_COMPLETED, self._forward_completed)
        self.on(engine, Events.ITERATION_COMPLETED, self._iteration_completed)
        self.on(engine, Events.EPOCH_COMPLETED, self._run_completed)

    def _detached(self, engine: Engine) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _before_call(self, module: torch.nn.Module, args: tuple) -> None:
        if self._thread == threading.get_ident():
            windows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 else 1
            self._calls.append([time_mark(self._device), None, windows])

    def _after_call(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if self._thread == threading.get_ident() and self._calls and self._calls[-1][1] is None:
            self._calls[-1][1] = time_mark(self._device)

    def _run_started(self, engine: Engine) -> None:
        self._totals = InferenceTimes()

    def _iteration_started(self, engine: Engine) -> None:
        self._thread = threading.get_ident()
        self._calls, self._forward_done = [], None
        self._start = time_mark(self._device)

    def _forward_completed(self, engine: Engine) -> None:
        self._forward_done = time_mark(self._device)

    def _iteration_completed(self, engine: Engine) -> None:
        end = time_mark(self._device)
        self._thread = None
        t, calls = self._totals, [c for c in self._calls if c[1] is not None]
        t.iterations += 1
        if not calls:
            t.after_s += seconds_between(self._start, end)
            return
        network = sum(seconds_between(a, b) for a, b, _ in calls)
        inferer_end = self._forward_done if self._forward_done is not None else calls[-1][1]
        t.network_calls += len(calls)
        t.windows += sum(n for _, _, n in calls)
        t.network_s += network
        t.sliding_window_s += max(0.0, seconds_between(calls[0][0], inferer_end) - network)
        t.before_s += seconds_between(self._start, calls[0][0])
        t.after_s += seconds_between(inferer_end, end)

    def _run_completed(self, engine: Engine) -> None:
        t = self._totals
        self.runs.append(t)
        if t.iterations and not t.network_calls and not self._warned:
            self._warned = True
            self.logger.warning(
                "InferenceSplit: the hooked network was not called during this run; pass "
                "network=<the module the inferer calls> (a compiled or wrapped copy?)"
            )
        add_row(engine, Kind.EPOCH, Source.INFERENCE, **t.as_dict())
        if t.iteration_s > 0:
            self.logger.debug(
                "InferenceSplit: %d iterations in %.2f s: network %.0f%%, sliding window around it %.0f%%, "
                "before %.0f%%, after %.0f%%",
                t.iterations,
                t.iteration_s,
                *(100 * part / t.iteration_s for part in (t.network_s, t.sliding_window_s, t.before_s, t.after_s)),
            )
