"""``FastTraining``: the fast-training guide's levers, applied to a trainer the user already has."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from ignite.engine import Engine, Events
from monai.data import SmartCacheDataset
from monai.engines import Trainer, Workflow

from monai_fast.data.adopt import AdoptedData, adopt_loader, why_not_adoptable
from monai_fast.data.background import BackgroundCacheDataset
from monai_fast.data.planner import CACHE_CHOICES, default_ram_budget
from monai_fast.folders import cache_root
from monai_fast.handlers.amp import AMPToggle
from monai_fast.handlers.compile import CompileChoice, validations_left
from monai_fast.handlers.core_pin import MainThreadCore
from monai_fast.handlers.guards import EpochLengthGuard, NonFiniteGuard
from monai_fast.handlers.lifecycle import EngineHandler, handlers_on, is_running, on_run_end
from monai_fast.handlers.memory_format import LayoutChoice
from monai_fast.handlers.prediction_layout import ClassesInnermost
from monai_fast.handlers.prefetch import PrefetchChoice, prefetch_for
from monai_fast.handlers.record import describe_engine, record_of
from monai_fast.handlers.smartcache import SmartCacheUpdater, rotated_on
from monai_fast.handlers.time_breakdown import TrainingAlgorithmTime
from monai_fast.handlers.window_tune import SlidingWindowTune, sliding_window_of
from monai_fast.telemetry import cuda_free_bytes
from monai_fast.telemetry.precision import REQUESTS
from monai_fast.telemetry.record import Kind, Lever, Source

__all__ = ["FastTraining"]

logger = logging.getLogger("monai_fast.handlers")


class FastTraining(EngineHandler):
    """Applies the fast-training guide's levers to an existing MONAI trainer (and its evaluator).

    Each lever is ``"auto"`` (applied where the device and a measurement say it pays), a setting, or ``False``;
    one log line and one record row per lever say why. The network, loss, optimizer, learning rate and batch
    size are never changed. The budgets and settings beside the levers (``gpu_budget_mib``, ``ram_budget_mib``,
    ``disk_budget_mib``, ``cache_dir``, ``cache_threads``, ``background_fill``, ``progress``, ``tune_store``,
    ``time_limit_s``) and when each lever is left alone: docs/fast-training.md.

    Args:
        cache: ``"auto"``, a place in `CACHE_PLACES`, or ``False``.
        loader: ``"auto"``, ``"thread"`` (adopt any collate function) or ``False`` (no cache either).
        precision: ``"auto"``, one of `REQUESTS`, or ``False``.
        memory_format: ``"auto"``, ``"channels_last_3d"``, ``"contiguous"`` or ``False``.
        compile: ``"auto"`` (measured, and only where it repays its compile), ``True`` or ``False``.
        evaluator: ``"auto"``, ``"tune"`` (also its ``sw_batch_size`` measured) or ``False``.
        prefetch: ``"auto"`` (measured on a CPU), ``True`` (batches made ahead) or ``False``.
        prediction_layout: ``"auto"`` (measured on a CPU), ``True`` or ``False``.

    Raises:
        ValueError: an option outside its choices (named with the value given).

    Examples:
        >>> fast = FastTraining(evaluator="tune")
        >>> fast.attach(trainer, evaluator)  # doctest: +SKIP
    """

    def __init__(
        self,
        cache: str | bool = "auto",
        loader: Literal["auto", "thread"] | bool = "auto",
        precision: Literal["auto", "bf16", "fp16", "fp32"] | bool = "auto",
        memory_format: Literal["auto", "channels_last_3d", "contiguous"] | bool = "auto",
        compile: Literal["auto"] | bool = "auto",
        evaluator: Literal["auto", "tune"] | bool = "auto",
        gpu_budget_mib: float | None = None,
        ram_budget_mib: float | None = None,
        disk_budget_mib: float | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_threads: int | None = None,
        background_fill: bool = False,
        prefetch: Literal["auto"] | bool = "auto",
        prediction_layout: Literal["auto"] | bool = "auto",
        progress: bool = False,
        tune_store: str | os.PathLike | None = "default",
        time_limit_s: float | Callable[[], float | None] | None = None,
    ) -> None:
        _check("cache", cache, (*CACHE_CHOICES, False))
        _check("loader", loader, ("auto", "thread", False))
        _check("precision", precision, (*REQUESTS, False))
        _check("memory_format", memory_format, ("auto", "channels_last_3d", "contiguous", False))
        _check("evaluator", evaluator, ("auto", "tune", False))
        for name, v in (("prefetch", prefetch), ("prediction_layout", prediction_layout), ("compile", compile)):
            if not (isinstance(v, bool) or v == "auto"):
                raise ValueError(f"FastTraining: {name} must be 'auto', True or False, got {v!r}")
        budgets = dict(gpu_budget_mib=gpu_budget_mib, ram_budget_mib=ram_budget_mib, disk_budget_mib=disk_budget_mib)
        for name, v in {**budgets, "cache_threads": cache_threads}.items():
            if v is not None and not v >= 0:
                raise ValueError(f"FastTraining: {name} must be >= 0 or None, got {v}")
        seconds = isinstance(time_limit_s, (int, float)) and not isinstance(time_limit_s, bool)
        if not (time_limit_s is None or callable(time_limit_s) or (seconds and time_limit_s > 0)):
            raise ValueError(f"FastTraining: time_limit_s must be > 0, a function or None, got {time_limit_s}")
        if cache == "disk" and cache_dir is None:
            raise ValueError("FastTraining: cache='disk' needs cache_dir")
        super().__init__()
        self.cache, self.loader, self.precision, self.memory_format = cache, loader, precision, memory_format
        self.evaluator_option, self.compile = evaluator, compile
        self.prefetch, self.prediction_layout = prefetch, prediction_layout
        self.budgets = budgets
        self.cache_dir, self.cache_threads = cache_dir, cache_threads
        self.progress, self.tune_store, self.time_limit_s = progress, tune_store, time_limit_s
        self._started: float | None = None  # the trainer's start, for a time limit given in seconds
        self.background_fill = bool(background_fill)
        self._train_cache: Any = None  # the trainer's adopted data set: the evaluator's background fill waits for it
        self._fills: list[Any] = []  # data sets filling in the background: no prefetch timing until all are full
        self._ram_left = 0  # bytes of the RAM budget not yet given to a cache, set at attach
        self._gpu_left: int | None = None  # the same for a GPU budget given
        self._warned = False  # a compile failure was warned of (the evaluator's is then a log line)
        #: per lever: {"applied": bool, "setting": ..., "reason": str}
        self.applied: dict[str, dict[str, Any]] = {}
        self.amp: AMPToggle | None = None
        self._pending_evaluator: Engine | None = None
        self._helpers: list[EngineHandler] = []
        self._choices: dict[str, PrefetchChoice] = {}  # by lever: the measured prefetch choices
        self._layout: LayoutChoice | None = None  # the trainer network's layout choice
        self._built_with: dict[int, tuple[Engine, Any]] = {}  # by engine: the loader it was built with

    def attach(self, trainer: Engine, evaluator: Engine | None = None) -> None:
        """Apply the levers to ``trainer`` (and ``evaluator``); call before ``trainer.run()``.

        Raises:
            TypeError: ``trainer`` is not a MONAI workflow with an optimizer (an evaluator alone).
            RuntimeError: already attached, or the trainer or the evaluator is inside ``run()``.
        """
        if not isinstance(trainer, Workflow) or not hasattr(trainer, "optimizer"):
            raise TypeError(
                "FastTraining needs a MONAI SupervisedTrainer (a monai.engines.Workflow with an optimizer) first, got "
                f"a {type(trainer).__name__}; an evaluator goes second, beside its trainer"
            )
        if evaluator is not None and not isinstance(evaluator, Workflow):
            raise TypeError(
                f"FastTraining: evaluator must be a MONAI SupervisedEvaluator, got {type(evaluator).__name__}"
            )
        for engine, name in ((trainer, "trainer"), (evaluator, "evaluator")):
            if engine is not None and is_running(engine):
                raise RuntimeError(
                    f"FastTraining: attach FastTraining before run(): the {name} is running (at "
                    f"{engine.last_event_name}), and a run keeps the data loader it started with"
                )
        self._pending_evaluator = evaluator
        super().attach(trainer)

    def _attach(self, trainer: Engine) -> None:
        evaluator, self._pending_evaluator = self._pending_evaluator, None
        device = torch.device(getattr(trainer.state, "device", None) or "cpu")
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self._apply_levers(trainer, evaluator, device)  # measuring here must not shift the run's random stream
        self.on(trainer, Events.STARTED, self._record)
        self.on(trainer, Events.STARTED, self._start_clock)
        self.on_run_end(trainer, self._conclude)

    def _start_clock(self, trainer: Engine) -> None:
        if self._started is None:
            self._started = time.monotonic()

    def _seconds_left(self) -> float | None:
        """The run's seconds left under ``time_limit_s`` (``None``: no limit)."""
        limit = self.time_limit_s
        if callable(limit):
            return limit()
        if limit is None:
            return None
        return limit - (time.monotonic() - self._started if self._started is not None else 0.0)

    def _conclude(self, trainer: Engine) -> None:
        """Every choice still measuring or waiting when the trainer's run ends keeps its setting, with its reason."""
        for helper in self._helpers:
            if isinstance(helper, (PrefetchChoice, CompileChoice)):
                helper.conclude()

    def _apply_levers(self, trainer: Workflow, evaluator: Workflow | None, device: torch.device) -> None:
        record = record_of(trainer)  # with a RecordHandler attached first, the fill is in the doctor's wall clock
        ram = self.budgets["ram_budget_mib"]  # one budget for both engines' caches: the evaluator gets what is left
        self._ram_left = default_ram_budget() if ram is None else int(ram * 2**20)
        gpu = self.budgets["gpu_budget_mib"]  # likewise the GPU budget: given, or half the memory free at attach
        free = cuda_free_bytes(device) if gpu is None else None
        self._gpu_left = int(gpu * 2**20) if gpu is not None else None if free is None else free // 2
        with record.span("cache_fill", Source.FAST_TRAINING) if record is not None else contextlib.nullcontext():
            self._data(trainer, Lever.DATA, device, trainer)
        if evaluator is not None and self.evaluator_option is False:
            self._say(Lever.EVALUATOR, False, None, "switched off (evaluator=False): the evaluator is kept as built")
            evaluator = None
        if evaluator is not None:
            with record.span("cache_fill", Source.FAST_TRAINING) if record is not None else contextlib.nullcontext():
                self._data(
                    evaluator,
                    Lever.VALIDATION_DATA,
                    torch.device(getattr(evaluator.state, "device", None) or device),
                    trainer,
                )
        for cls, engine, args in (  # each unless already there
            (NonFiniteGuard, trainer, ()),  # every precision, also with precision=False or MONAI's amp
            (EpochLengthGuard, trainer, ("training",)),  # no metric from a short epoch
            (EpochLengthGuard, evaluator, ("validation",)),
            (TrainingAlgorithmTime, trainer, ()),  # the user's post-processing and metrics, timed
            (MainThreadCore, trainer, ()),  # registers nothing unless OpenMP's workers were pinned
            (MainThreadCore, evaluator, ()),
        ):
            if engine is not None and cls not in handlers_on(engine):
                self._add(cls(*args), engine)
        timer = next((h for h in self._helpers if isinstance(h, TrainingAlgorithmTime)), None)
        if timer is not None and timer.timed:
            logger.info(
                "FastTraining: the training post-processing and metrics (%s) are kept as built and timed per epoch",
                ", ".join(timer.timed),
            )
        self._precision(trainer, evaluator, device)
        self._memory_format_lever(trainer)
        self._compile_lever(trainer, evaluator)
        if evaluator is not None:
            self._validation_lever(trainer, evaluator, device)
        self._prediction_layout_lever(trainer, evaluator)

    def _detached(self, engine: Engine) -> None:
        for helper in reversed(self._helpers):  # last wrapped, first unwrapped (inferer wrappers nest)
            for e in helper.engines:
                helper.detach(e)
        self._helpers.clear()
        for e, loader in self._built_with.values():  # a run keeps the loader it started with: given back at its end
            if is_running(e):
                on_run_end(e, lambda engine, loader=loader: setattr(engine, "data_loader", loader), once=True)
            else:
                e.data_loader = loader
        self._built_with.clear()

    def _add(self, handler: EngineHandler, engine: Engine) -> None:
        handler.attach(engine)
        self._helpers.append(handler)

    def _say(
        self, lever: str, applied: bool, setting: Any, reason: str, evidence: dict | None = None, warn: bool = False
    ) -> None:
        self.applied[lever] = {"applied": applied, "setting": setting, "reason": reason}
        if evidence:  # the measurement behind a decision (every round), for the record and the doctor
            self.applied[lever]["evidence"] = evidence
        say = logger.warning if warn else logger.info
        say("FastTraining %s: %s%s", lever, f"{setting}: " if applied else "left alone: ", reason)

    def _decided(self, trainer: Engine, lever: str, *said: Any) -> None:
        """`_say()` a decision taken while the trainer runs, and add it to the run's record."""
        self._say(lever, *said)
        self._record(trainer, only=lever)

    def _data(self, engine: Workflow, lever: str, device: torch.device, trainer: Engine) -> None:
        if self.loader is False or self.cache is False:
            self._say(lever, False, None, "switched off (loader=False or cache=False)")
            return
        why = why_not_adoptable(engine.data_loader, force_thread=self.loader == "thread")
        ds = getattr(engine.data_loader, "dataset", None)
        rotated = isinstance(ds, SmartCacheDataset) and (rotated_on(engine, ds) or rotated_on(trainer, ds))
        if why is None and isinstance(ds, SmartCacheDataset) and not rotated:
            why = (
                f"the {type(ds).__name__}'s window never rotates (no SmartCacheHandler on the engine), so every epoch "
                "trains on the same items, as the script does; SmartCacheHandler(ds) or SmartCacheUpdater() rotates it"
            )
            self._say(lever, False, None, why, warn=True)
            return
        if why is not None:
            self._say(lever, False, None, why)
            return
        user, before = engine.data_loader, len(engine.data_loader)
        adopted: AdoptedData = adopt_loader(
            engine.data_loader,
            device,
            cache="auto" if self.cache is True else self.cache,
            cache_dir=self.cache_dir if self.cache_dir is not None else cache_root() / "crops",
            cache_threads=self.cache_threads,
            progress=self.progress,
            force_thread=self.loader == "thread",
            background=self.background_fill,
            after=self._train_cache,
            **{
                **self.budgets,
                "ram_budget_mib": self._ram_left / 2**20,
                "gpu_budget_mib": None if self._gpu_left is None else self._gpu_left / 2**20,
            },
        )
        if adopted.plan is not None and adopted.plan.ram_bytes:
            self._ram_left = max(0, self._ram_left - adopted.plan.ram_bytes)
            adopted.notes.append(f"{self._ram_left / 2**20:.1f} MiB of the RAM budget left for the next cache")
        if adopted.plan is not None and adopted.plan.where == "gpu" and self._gpu_left is not None:
            self._gpu_left = max(0, self._gpu_left - adopted.plan.total_bytes)
            adopted.notes.append(f"{self._gpu_left / 2**20:.1f} MiB of the GPU budget left for the next cache")
        if self._train_cache is None:
            self._train_cache = adopted.dataset
        if isinstance(adopted.dataset, BackgroundCacheDataset):
            self._fills.append(adopted.dataset)
        engine.data_loader = adopted.loader
        self._built_with[id(engine)] = (engine, user)
        if adopted.copied is not None:  # the script may change its data set's items between epochs
            follow = functools.partial(self._follow_items, lever, adopted, trainer)
            self.on(engine, Events.EPOCH_STARTED, follow, owner=trainer)
        if len(adopted.loader) != before:
            why = f"{len(adopted.loader)} batches per epoch instead of {before} (the per-rank partition pads evenly)"
            logger.warning("FastTraining %s: %s", lever, why)
        if adopted.smartcache:
            updater = SmartCacheUpdater(adopted.dataset)
            self._add(updater, engine)
        self._say(lever, True, adopted.where, "; ".join(adopted.notes))
        name = Lever.PREFETCH if lever is Lever.DATA else Lever.VALIDATION_PREFETCH
        setting, why, choice = prefetch_for(
            adopted.loader,
            device,
            self.prefetch,
            functools.partial(self._prefetch_chosen, trainer, name),
            ready=self._ready_to_time,
            conclude_at_run_end=engine is trainer,  # an evaluator's short runs add up until the trainer's run ends
        )
        if choice is not None:
            self._add(choice, engine)
            self._choices[name] = choice
        self._say(name, True, setting, why)

    def _follow_items(self, lever: str, adopted: AdoptedData, trainer: Engine, engine: Engine) -> None:
        """Once the script changed the items of its data set, its own loader serves them (uncached), as without us."""
        if engine.data_loader is not adopted.loader or not adopted.source_changed():
            return
        # the pass under way ends as it would; ignite starts the next one (and a later run) from the script's loader
        engine.data_loader = engine.state.dataloader = self._built_with[id(engine)][1]
        if adopted.dataset in self._fills:
            self._fills.remove(adopted.dataset)  # no timing waits for a cache nothing reads
        choice = self._choices.pop(Lever.PREFETCH if lever is Lever.DATA else Lever.VALIDATION_PREFETCH, None)
        if choice is not None:  # it would time the script's loader while switching the cached one
            choice.detach(engine)
            self._helpers.remove(choice)
        why = (
            f"the script changed its data set's items before epoch {engine.state.epoch}: the cache holds the old "
            "ones, so the script's own loader serves from here, uncached (a MONAI CacheDataset's set_data() keeps one)"
        )
        self._decided(trainer, lever, False, None, why, None, True)

    def _ready_to_time(self) -> bool:
        """Caches full and the layout chosen: a loader's timing is not disturbed by either."""
        return all(ds.complete for ds in self._fills) and self._layout_settled()

    def _layout_settled(self, trainer: Engine | None = None) -> bool:
        layout = self._layout  # with the trainer: also a batch of the shape its rounds timed (a full one)
        return layout is None or (layout.settled_at(trainer.state.batch) if trainer else layout.chosen)

    def _dtype(self) -> torch.dtype | None:
        return self.amp.autocast_dtype if self.amp is not None and self.amp.active else None

    def _prefetch_chosen(self, trainer: Engine, name: str, prefetch: bool, reason: str) -> None:
        measured = name in self._choices and self._choices[name].measured
        reason = f"measured {reason}" if measured else reason
        self._decided(trainer, name, True, "ahead" if prefetch else "on demand", reason)

    def _precision(self, trainer: Workflow, evaluator: Workflow | None, device: torch.device) -> None:
        if self.precision is False:
            self._say(Lever.PRECISION, False, None, "switched off (precision=False)")
            return
        monai_amp = bool(getattr(trainer, "amp", False))
        if monai_amp and device.type == "cuda":
            self._say(Lever.PRECISION, False, None, "the trainer already runs MONAI's amp=True on CUDA; kept as built")
            return
        if self.precision == "fp32":
            self._say(Lever.PRECISION, False, "fp32", "requested fp32: engines kept as built")
            return
        # MONAI's amp=True autocasts for "cuda" only, so off CUDA it changes nothing: it is read as a request for
        # reduced precision, which the toggle applies where the device runs it (and MONAI's no-op flag is set off)
        amp = AMPToggle("auto" if self.precision is True else self.precision)
        self._add(amp, trainer)
        self.amp = amp
        self._after_first_step(trainer, Lever.PRECISION, amp, trainer)
        if evaluator is not None and not (getattr(evaluator, "amp", False) and device.type == "cuda"):
            ev = AMPToggle(amp.precision)
            self._add(ev, evaluator)
            self._after_first_step(evaluator, "validation precision", ev, trainer)
        reason = {
            "bf16": f"{device.type} runs bf16 natively" + (" and it measured faster" if device.type == "cpu" else ""),
            "fp16": "this GPU has no fast bf16: fp16 with a GradScaler",
            "fp32": "no reduced precision pays on this device",
        }.get(amp.precision, "")
        if self.precision in ("bf16", "fp16"):  # asked for, not decided here
            reason = f"requested {self.precision}"
        if monai_amp:
            reason = (
                f"MONAI's amp=True autocasts for CUDA only and does nothing on {device.type}: read as a request "
                f"for reduced precision; {reason or 'requested ' + str(self.precision)}"
            )
        self._say(Lever.PRECISION, amp.precision != "fp32", amp.precision, reason or f"requested {self.precision}")

    def _after_first_step(self, engine: Engine, lever: str, handler: Any, trainer: Engine) -> None:
        """`_acted()` once ``engine`` has taken its first step."""
        self.on(engine, Events.ITERATION_COMPLETED(once=1), self._acted, lever, handler, trainer, owner=trainer)

    def _acted(self, engine: Engine, lever: str, handler: Any, trainer: Engine) -> None:
        """After the engine's first step: a lever whose handler found the step out of its reach is not applied."""
        if handler.unused is None or self.applied.get(lever, {}).get("applied") is False:
            return
        self._decided(trainer, lever, False, getattr(handler, "precision", None), f"did not act: {handler.unused}")

    def _memory_format_lever(self, trainer: Workflow) -> None:
        if self.memory_format is False:
            self._say(Lever.MEMORY_FORMAT, False, None, "switched off (memory_format=False)")
            return
        request = "auto" if self.memory_format is True else self.memory_format
        on_choice = functools.partial(self._layout_chosen, trainer)
        self._layout = LayoutChoice(request, self._dtype, on_choice, seconds_left=self._seconds_left)
        self._add(self._layout, trainer)

    def _layout_chosen(self, trainer: Engine, layout: str, reason: str, evidence: dict[str, Any] | None) -> None:
        self._decided(trainer, Lever.MEMORY_FORMAT, layout == "channels_last_3d", layout, reason, evidence)

    def _compile_lever(self, trainer: Workflow, evaluator: Workflow | None) -> None:
        engines = [(Lever.COMPILE, trainer), *([(Lever.VALIDATION_COMPILE, evaluator)] if evaluator else [])]
        for lever, engine in engines:
            if self.compile is False:
                self._say(lever, False, None, "switched off (compile=False)")
                continue
            choice = CompileChoice(
                self.compile,
                dtype=self._dtype,
                on_choice=functools.partial(self._compiled, trainer, lever),
                store=self.tune_store,  # the compile time beside the other measurements of this machine
                evaluation=engine is not trainer,
                runs_left=functools.partial(validations_left, trainer) if engine is not trainer else None,
                seconds_left=self._seconds_left,
                memory_formats=self.memory_format in ("auto", True),  # the layout measured again, compiled
                eager_step=self._layout.step if engine is trainer and self._layout else None,
                ready=functools.partial(self._layout_settled, trainer) if engine is trainer else self._layout_settled,
            )
            self._add(choice, engine)  # after the memory format: the copy it measures is in the chosen layout

    def _compiled(self, trainer: Engine, lever: Lever, compiled: bool, reason: str, evidence: dict[str, Any]) -> None:
        failed = not compiled and "failed" in reason  # no compiler here: one warning, not one per engine
        setting = "compiled" if compiled else "eager"
        self._say(lever, compiled, setting, reason, evidence, warn=failed and not self._warned)
        self._warned = self._warned or failed
        self._record(trainer, only=lever)
        layouts = evidence.get("memory_format") or {}
        if compiled and layouts and layouts["choice"] == layouts["candidate"]:  # moved to the other layout, compiled
            moved = (layouts["choice"] == "channels_last_3d", layouts["choice"], f"{layouts['reason']} (compiled)")
            self._decided(trainer, Lever.MEMORY_FORMAT, *moved, layouts)

    def _prediction_layout_lever(self, trainer: Workflow, evaluator: Workflow | None) -> None:
        if self.prediction_layout is False:
            self._say(Lever.PREDICTION_LAYOUT, False, None, "switched off (prediction_layout=False)")
            return
        dims = describe_engine(evaluator or trainer)["spatial_dims"]  # from the network's convolutions
        if self.prediction_layout == "auto" and dims is not None and dims != 3:
            self._say(Lever.PREDICTION_LAYOUT, False, None, f"a {dims}-D network: no 5-D predictions to reorder")
            return
        engines = [e for e in (trainer if isinstance(trainer, Trainer) else None, evaluator) if e is not None]
        if not engines:
            self._say(Lever.PREDICTION_LAYOUT, False, None, "no MONAI trainer nor evaluator: no predictions to reorder")
            return
        layout = ClassesInnermost(self.prediction_layout)
        for engine in engines:
            self._add(layout, engine)
        acts = layout.active and (evaluator is not None or bool(layout.argmax_transforms.get(id(trainer))))
        self._say(Lever.PREDICTION_LAYOUT, acts, "classes innermost" if acts else None, layout.reason)
        if layout.active and evaluator is not None:
            self._after_first_step(evaluator, Lever.PREDICTION_LAYOUT, layout, trainer)

    def _validation_lever(self, trainer: Workflow, evaluator: Workflow, device: torch.device) -> None:
        inferer = getattr(evaluator, "inferer", None)  # a Workflow of one's own may have none
        if inferer is None or sliding_window_of(inferer) is None:  # said first: no sliding-window advice for it
            why = f"the evaluator's inferer ({type(inferer).__name__}) is not a SlidingWindowInferer: nothing to tune"
            self._say(Lever.EVALUATOR, False, None, why)
            return
        if self.evaluator_option == "auto" or self.evaluator_option is True:
            why = "sliding-window settings kept as built (evaluator='tune' measures them)"
            self._say(Lever.EVALUATOR, False, None, why)
            return
        tune = SlidingWindowTune(
            lambda: self.amp.precision if self.amp is not None and self.amp.active else "fp32",
            device,
            self.tune_store,
            on_result=functools.partial(self._decided, trainer, Lever.EVALUATOR),
        )
        self._add(tune, evaluator)

    def _record(self, trainer: Engine, only: str | None = None) -> None:
        record = record_of(trainer)
        if record is None:
            return
        for lever, what in self.applied.items():
            if only is None or lever == only:
                record.add(Kind.EVENT, Source.FAST_TRAINING, lever=lever, **what)
        record.set_summary(Source.FAST_TRAINING, dict(self.applied))


def _check(name: str, value: Any, allowed: tuple) -> None:
    if value is not True and value not in allowed:
        raise ValueError(f"FastTraining: {name} must be one of {', '.join(map(repr, allowed))} or True, got {value!r}")
