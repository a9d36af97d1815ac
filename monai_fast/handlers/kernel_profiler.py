"""``torch.profiler`` over a window of iterations: a chrome trace and a DLProf-style kernel summary."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import ignite.distributed as idist
from ignite.engine import Engine, Events
from torch.profiler import ProfilerActivity, profile, schedule

from monai_fast.files import NoSpaceError, atomic_path, write_json
from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.record import record_of
from monai_fast.telemetry import cuda_available
from monai_fast.telemetry.record import Source

__all__ = ["KernelProfiler", "summarise_profile"]

logger = logging.getLogger("monai_fast.handlers")


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
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(self.output_dir, os.W_OK):
            raise PermissionError(f"KernelProfiler output_dir {self.output_dir} is not writable")
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
