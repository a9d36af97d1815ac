"""Background NVML sampling of the GPUs a rank uses: record rows, CSV, TensorBoard, summary."""

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

from monai_fast.files import no_space_in
from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.record import record_of
from monai_fast.telemetry.cuda import cuda_device_uuid
from monai_fast.telemetry.nvml import FIELDS, NvmlBackend, NvmlUnavailable, open_nvml, visible_gpu_indices
from monai_fast.telemetry.record import Kind, Source

__all__ = ["GPUSampler"]

logger = logging.getLogger("monai_fast.handlers")

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
        self.output_dir = Path(output_dir) if output_dir is not None else None
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.output_dir, os.W_OK):
                raise PermissionError(f"GPUSampler output_dir {self.output_dir} is not writable")
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
        self._summarise(engine)
        if self._error is not None:
            err, self._error = self._error, None
            logger.error("GPUSampler's sampling thread failed; GPU samples stop at that point", exc_info=err)

    def _summarise(self, engine: Engine) -> None:
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
