"""Profiling a run: background NVML sampling of the GPUs (`GPUSampler`), ``torch.profiler`` over a window of
iterations (`KernelProfiler`: a chrome trace and a DLProf-style kernel summary), and NVTX ranges for an engine and
for transforms, to read in Nsight Systems (`NVTXHandler`, `nvtx_range()`)."""

from __future__ import annotations

import csv
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ignite.distributed as idist
from ignite.engine import Engine, Events
from monai.engines import Workflow
from monai.engines.utils import IterationEvents
from monai.transforms import InvertibleTransform, Randomizable, Transform
from torch.profiler import ProfilerActivity, profile, schedule

from monai_fast.extras import MissingExtraError
from monai_fast.files import NoSpaceError, atomic_path, no_space_in, write_json
from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.record import record_of
from monai_fast.telemetry import cuda_available
from monai_fast.telemetry.cuda import cuda_device_uuid
from monai_fast.telemetry.nvml import FIELDS, NvmlBackend, NvmlUnavailable, open_nvml, visible_gpu_indices
from monai_fast.telemetry.nvtx import NvtxBackend, PackageNvtx
from monai_fast.telemetry.record import Kind, Source

__all__ = ["COLORS", "GPUSampler", "KernelProfiler", "NVTXHandler", "nvtx_range", "summarise_profile"]

logger = logging.getLogger("monai_fast.handlers")


def _writable_folder(output_dir: str | os.PathLike, owner: str) -> Path:
    """``output_dir``, created; `PermissionError` naming ``owner`` when it is not writable."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{owner} output_dir {folder} is not writable")
    return folder


_AGGREGATED = ("gpu_util", "mem_used_mib", "power_w")  # the readings summarised per GPU, also sent to TensorBoard


class GPUSampler(EngineHandler):
    """Samples GPU utilisation, memory, power, temperature and SM clock on a background thread.

    Samples become record rows, a ``gpu_rank<R>.csv`` and, with ``writer``, TensorBoard scalars;
    `summary` holds mean and peak per GPU. Without NVML: one warning, nothing else (docs/monitoring.md).

    Args:
        interval_s: seconds between samples (> 0).
        gpus: NVML indices; default the GPU this process trains on (`visible_gpu_indices()`).
        output_dir: where ``gpu_rank<R>.csv`` goes (checked here); ``None``: the record's run folder.
        writer: a TensorBoard ``SummaryWriter`` for ``gpu<i>/util`` etc.
        backend: an NVML backend; default the real one (tests pass ``FakeNvml``).

    Examples:
        >>> GPUSampler(interval_s=0.5, output_dir="runs/exp1").attach(trainer)  # doctest: +SKIP
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        gpus: Sequence[int] | None = None,
        output_dir: str | os.PathLike | None = None,
        writer: Any = None,
        backend: NvmlBackend | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if gpus is not None and (not gpus or any(int(g) < 0 for g in gpus)):
            raise ValueError(f"gpus must be a non-empty list of NVML indices >= 0, got {gpus}")
        self.output_dir = _writable_folder(output_dir, "GPUSampler") if output_dir is not None else None
        super().__init__()
        self.interval_s = float(interval_s)
        self.gpus = [int(g) for g in gpus] if gpus is not None else None
        self.writer = writer
        self._backend = backend
        self.n_samples = 0
        self.summary: dict[str, dict] = {}
        self._agg: dict[int, dict] = {}
        self._csv_file = self._csv = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.active = False

    def _attach(self, engine: Engine) -> None:
        if self._backend is None:
            try:
                self._backend = open_nvml()
            except NvmlUnavailable as e:
                logger.warning("GPUSampler: %s; GPU sampling is off, training is unaffected", e)
                return
        count = self._backend.device_count()
        if self.gpus is None:
            device = getattr(engine.state, "device", None)  # MONAI engines; else this process's current CUDA device
            uuid = cuda_device_uuid(device if device is not None and str(device).startswith("cuda") else None)
            self.gpus = visible_gpu_indices(idist.get_local_rank(), self._backend, uuid)
        bad = [g for g in self.gpus if g >= count]
        if bad:
            raise ValueError(f"GPUSampler: gpus {bad} do not exist; NVML sees {count} GPU(s)")
        self.active = True
        self.on(engine, Events.STARTED, self._start)
        self.on_run_end(engine, self._finish)

    def _detached(self, engine: Engine) -> None:
        self._finish(engine)
        self.active = False

    def _start(self, engine: Engine) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._t0 = time.time()
        record = record_of(engine)
        out = self.output_dir or (record.run_dir if record is not None else None)
        if out is not None:  # streamed while sampling: a run of days does not pile up in memory
            self._csv_file = open(Path(out) / f"gpu_rank{idist.get_rank()}.csv", "w", newline="")
            self._csv = csv.writer(self._csv_file)
            self._csv.writerow(["time", "gpu", "gpu_util", "used", "total", "ratio", *FIELDS[4:]])
        self._thread = threading.Thread(target=self._loop, name="monai-fast-gpu-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        record = record_of(self.engine) if self.engine is not None else None
        rank = idist.get_rank()
        round_ = 0  # TensorBoard step: one per sampling round, never reset by the plot's decimation
        try:
            while True:
                round_ += 1
                now = time.time()
                for g in self.gpus or []:
                    values = self._backend.sample(g)  # type: ignore[union-attr]
                    row = {"gpu": g, "t": now - self._t0, **values}
                    self._keep(row)
                    if record is not None:
                        record.add(Kind.INTERVAL, Source.GPU, **row)
                    if self.writer is not None:
                        for k in _AGGREGATED:
                            self.writer.add_scalar(f"rank{rank}/gpu{g}/{k}", values[k], round_, walltime=now)
                if self._stop.wait(self.interval_s):
                    return
        except BaseException as e:  # reported on the training thread when the run ends
            csv_path = getattr(self._csv_file, "name", None)
            self._error = (no_space_in(e, csv_path) or e) if isinstance(e, Exception) else e

    def _keep(self, row: dict) -> None:
        agg = self._agg.setdefault(row["gpu"], {"n": 0, **{k: [0.0, 0, None] for k in _AGGREGATED}})
        agg["n"] += 1
        agg["mem_total"] = row["mem_total_mib"]
        for k in _AGGREGATED:  # [sum, count, peak] of the readings NVML gave (NaN: not supported)
            if not math.isnan(value := row[k]):
                total = agg[k]
                total[0], total[1], total[2] = total[0] + value, total[1] + 1, max(total[2] or 0.0, value)
        if self._csv is not None:
            self._csv.writerow(
                [
                    f"{row['t']:.3f}",
                    row["gpu"],
                    row["gpu_util"],
                    f"{row['mem_used_mib']:.1f}",
                    f"{row['mem_total_mib']:.1f}",
                    f"{100 * row['mem_used_mib'] / row['mem_total_mib']:.2f}",
                    *(row[k] for k in FIELDS[4:]),
                ]
            )
        self.n_samples += 1

    def _finish(self, engine: Engine) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=max(5.0, 3 * self.interval_s))
        self._thread = None
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = self._csv = None
        for g, a in self._agg.items():
            util, mem, power = (a[k] for k in _AGGREGATED)
            self.summary[f"gpu{g}"] = {
                "name": self._backend.name(g),  # type: ignore[union-attr]
                "samples": a["n"],
                "gpu_util_mean": util[0] / util[1] if util[1] else None,
                "gpu_util_peak": util[2],
                "mem_used_peak_mib": mem[2],
                "mem_total_mib": a.get("mem_total"),
                "power_mean_w": power[0] / power[1] if power[1] else None,
            }
        if (record := record_of(engine)) is not None:
            record.set_summary(Source.GPU, self.summary)
        if self._error is not None:
            err, self._error = self._error, None
            logger.error("GPUSampler's sampling thread failed; GPU samples stop at that point", exc_info=err)


def summarise_profile(key_averages: Any, top: int = 15) -> dict:
    """A DLProf-like summary of ``prof.key_averages()``: device kernels and CPU ops counted apart.

    Adding op rows to kernel rows would count GPU time twice. ``top`` lists the kernels by GPU time,
    or the ops by CPU time when nothing ran on a device.
    """
    ops, kernels = [], []
    for e in key_averages:  # a device kernel: not a CPU op, nor a user range
        device = "CPU" not in str(getattr(e, "device_type", "CPU")) and not getattr(e, "is_user_annotation", False)
        (kernels if device else ops).append(
            {
                "name": e.key,
                "calls": int(e.count),
                "cpu_time_ns": round(float(e.self_cpu_time_total) * 1000),
                "gpu_time_ns": round(float(getattr(e, "self_device_time_total", 0.0) or 0.0) * 1000) if device else 0,
            }
        )
    on_gpu = bool(kernels)
    ranked_by = "gpu_time_ns" if on_gpu else "cpu_time_ns"
    ranked = sorted(kernels if on_gpu else ops, key=lambda r: r[ranked_by], reverse=True)
    return {
        "All kernels": {
            "# Kernels": len(kernels),
            "# Ops": len(ops),
            "# Calls": sum(r["calls"] for r in ops),
            "CPU Time (ns)": sum(r["cpu_time_ns"] for r in ops),
            "GPU Time (ns)": sum(r["gpu_time_ns"] for r in kernels),
        },
        "ranked_by": ranked_by,
        "top": ranked[:top],
    }


class KernelProfiler(EngineHandler):
    """Profiles a window of iterations with ``torch.profiler`` (DLProf is retired).

    Writes ``trace_rank<R>.json`` (Chrome trace) and ``kernels_rank<R>.json`` (a kernel summary in
    DLProf's report shape) after the window; the profiler stops however the run ends.

    Args:
        output_dir: folder for the trace and summary (checked for writability here).
        wait: iterations skipped before the ``torch.profiler.schedule`` window.
        warmup: iterations profiled but discarded, to warm the profiler up.
        active: iterations recorded.
        record_shapes: record input shapes (bigger trace).
        top: number of ops listed in the summary.

    Examples:
        >>> KernelProfiler("runs/exp1", wait=5, warmup=2, active=5).attach(trainer)  # doctest: +SKIP
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        wait: int = 2,
        warmup: int = 1,
        active: int = 3,
        record_shapes: bool = False,
        top: int = 15,
    ) -> None:
        if wait < 0 or warmup < 0 or active < 1:
            raise ValueError(f"need wait >= 0, warmup >= 0, active >= 1; got {wait}, {warmup}, {active}")
        self.output_dir = _writable_folder(output_dir, "KernelProfiler")
        super().__init__()
        self.wait, self.warmup, self.active = wait, warmup, active
        self.record_shapes, self.top = record_shapes, top
        self.summary: dict | None = None
        self._prof: profile | None = None

    @property
    def profiling(self) -> bool:
        """Whether the profiler is running now (from the run's start to the window's or the run's end)."""
        return self._prof is not None

    def _attach(self, engine: Engine) -> None:
        self.on(engine, Events.STARTED, self._start)
        self.on(engine, Events.ITERATION_COMPLETED, self._step)
        self.on_run_end(engine, self._stop)

    def _detached(self, engine: Engine) -> None:
        self._stop(engine)

    def _start(self, engine: Engine) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda_available() else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._ready,
            record_shapes=self.record_shapes,
        )
        self._prof.__enter__()

    def _step(self, engine: Engine) -> None:
        if self._prof is not None:
            self._prof.step()

    def _stop(self, engine: Engine) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)

    def _ready(self, prof: profile) -> None:
        rank = idist.get_rank()
        self.summary = summarise_profile(prof.key_averages(), self.top)
        try:  # whole files or none; a full disk is named and training goes on (the summary stays in memory)
            with atomic_path(self.output_dir / f"trace_rank{rank}.json") as tmp:
                prof.export_chrome_trace(str(tmp))
            write_json(self.summary, self.output_dir / f"kernels_rank{rank}.json")
        except NoSpaceError as err:
            logger.warning("KernelProfiler: profile not written: %s", err)
        totals = self.summary["All kernels"]
        if self.engine is not None and (record := record_of(self.engine)) is not None:
            record.set_summary(
                Source.KERNELS, totals | {"ranked_by": self.summary["ranked_by"], "top": self.summary["top"][:5]}
            )
        logger.info(
            "profiled %d iterations: %d ops, CPU %.1f ms, GPU %.1f ms -> %s",
            self.active,
            totals["# Ops"],
            totals["CPU Time (ns)"] / 1e6,
            totals["GPU Time (ns)"] / 1e6,
            self.output_dir,
        )


COLORS = {
    "run": "purple",
    "epoch": "blue",
    "get batch": "red",
    "iteration": "yellow",
    "forward": "green",
    "loss": "orange",
    "backward": "cyan",
    "optimizer step": "magenta",
    "transform": "grey",
}


class NVTXHandler(EngineHandler):
    """Marks an engine's work with nested NVTX ranges, named with rank and role (docs/monitoring.md).

    Args:
        label: role in range names; default ``"validation"`` for MONAI evaluators, else ``"train"``.
        backend: where ranges go; default the ``nvtx`` package (no-op without a profiler; without the package, one
            warning and no ranges).

    Examples:
        >>> NVTXHandler().attach(trainer)  # doctest: +SKIP
    """

    def __init__(self, label: str | None = None, backend: NvtxBackend | None = None) -> None:
        if label is not None and not label.strip():
            raise ValueError("label must be a non-empty string or None")
        super().__init__()
        self.label = label
        if backend is None:
            try:
                backend = PackageNvtx()
            except MissingExtraError as e:  # ranges are for a profiler: without the package, none are marked
                logger.warning("NVTXHandler: %s; no NVTX ranges are marked, training is unaffected", e)
        self.backend: NvtxBackend | None = backend
        self._stacks: dict[int, list[str]] = {}
        self._names: dict[int, str] = {}
        self._with_phases: set[int] = set()

    multi_engine = True  # ranges are kept per engine

    def _attach(self, engine: Engine) -> None:
        if self.backend is None:
            return
        label = self.label or ("validation" if "Evaluator" in type(engine).__name__ else "train")
        self._names[id(engine)] = f"rank{idist.get_rank()} {label}"
        self._stacks[id(engine)] = []

        self.on(engine, Events.STARTED, self._push, "run")
        self.on(engine, Events.EPOCH_STARTED, self._push_epoch)
        self.on(engine, Events.GET_BATCH_STARTED, self._push, "get batch")
        self.on(engine, Events.GET_BATCH_COMPLETED, self._pop_to, "get batch")
        self.on(engine, Events.ITERATION_STARTED, self._iteration_started)
        self.on(engine, Events.ITERATION_COMPLETED, self._pop_to, "iteration")
        self.on(engine, Events.EPOCH_COMPLETED, self._pop_to, "epoch")
        self.on_run_end(engine, self._pop_all)
        if isinstance(engine, Workflow):  # a MONAI engine: it fires IterationEvents
            self._with_phases.add(id(engine))
            trains = hasattr(engine, "optimizer")
            self.on(engine, IterationEvents.FORWARD_COMPLETED, self._switch, "forward", "loss" if trains else None)
            if trains:
                self.on(engine, IterationEvents.LOSS_COMPLETED, self._switch, "loss", "backward")
                self.on(engine, IterationEvents.BACKWARD_COMPLETED, self._switch, "backward", "optimizer step")
                self.on(engine, IterationEvents.MODEL_COMPLETED, self._switch, "optimizer step", None)

    def _detached(self, engine: Engine) -> None:
        if id(engine) in self._stacks:
            self._pop_all(engine)
            del self._stacks[id(engine)]
        self._names.pop(id(engine), None)
        self._with_phases.discard(id(engine))

    def _push(self, engine: Engine, phase: str, detail: str = "") -> None:
        self.backend.push(f"{self._names[id(engine)]}: {phase}{detail}", COLORS[phase])
        self._stacks[id(engine)].append(phase)

    def _pop_to(self, engine: Engine, phase: str) -> None:  # one stack per engine, always popped in order
        stack = self._stacks[id(engine)]
        if phase not in stack:
            return
        while stack:
            top = stack.pop()
            self.backend.pop()
            if top == phase:
                return

    def _pop_all(self, engine: Engine) -> None:
        stack = self._stacks[id(engine)]
        while stack:
            stack.pop()
            self.backend.pop()

    def _push_epoch(self, engine: Engine) -> None:
        self._push(engine, "epoch", f" {engine.state.epoch}")

    def _iteration_started(self, engine: Engine) -> None:
        self._push(engine, "iteration")
        if id(engine) in self._with_phases:
            self._push(engine, "forward")

    def _switch(self, engine: Engine, done: str, following: str | None) -> None:
        self._pop_to(engine, done)
        if following is not None:
            self._push(engine, following)


class _NVTXRange(Transform):
    """Wraps one transform in an NVTX range; see `nvtx_range()`."""

    def __init__(self, transform: Any, name: str, backend: NvtxBackend) -> None:
        self.transform = transform
        self.name = name
        self.backend = backend

    def __call__(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        self.backend.push(self.name, COLORS["transform"])
        try:
            return self.transform(data, *args, **kwargs)
        finally:
            self.backend.pop()


class _RandomNVTXRange(_NVTXRange, Randomizable):
    """The wrapper of a random transform stays random, so caches still stop in front of it."""

    def set_random_state(self, seed: int | None = None, state: Any = None) -> _RandomNVTXRange:
        self.transform.set_random_state(seed=seed, state=state)
        return self

    def randomize(self, data: Any) -> None:
        self.transform.randomize(data)


class _InvertibleNVTXRange(_NVTXRange, InvertibleTransform):
    """The wrapper of an invertible transform stays invertible: ``Compose.inverse`` undoes it."""

    def inverse(self, data: Any) -> Any:
        self.backend.push(f"{self.name} inverse", COLORS["transform"])
        try:
            return self.transform.inverse(data)
        finally:
            self.backend.pop()


class _RandomInvertibleNVTXRange(_InvertibleNVTXRange, _RandomNVTXRange):
    """Random and invertible (``RandFlipd``, ``RandRotate90d``, ...)."""


def nvtx_range(transform: Any, name: str | None = None, backend: NvtxBackend | None = None) -> Transform:
    """Wrap a transform so each call is an NVTX range (like MONAI's ``Range``, on the ``nvtx`` package).

    The wrapper stays ``Randomizable`` / ``InvertibleTransform`` where the transform is (caching, ``inverse``).

    Examples:
        >>> chain = Compose([nvtx_range(LoadImaged(keys="image")), nvtx_range(Spacingd("image", 1.5), "Spacing")])
    """
    if isinstance(transform, InvertibleTransform):
        cls = _RandomInvertibleNVTXRange if isinstance(transform, Randomizable) else _InvertibleNVTXRange
    else:
        cls = _RandomNVTXRange if isinstance(transform, Randomizable) else _NVTXRange
    return cls(transform, name or type(transform).__name__, backend if backend is not None else PackageNvtx())
