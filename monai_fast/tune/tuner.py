"""`Tuner`: pick batch size, sliding-window batch, validation device and precision by measured throughput.

Where Auto3DSeg's "GPU customization" keeps what fits in memory, `Tuner` keeps what runs fastest within a
memory budget; an out-of-memory candidate is infeasible, not a crash (docs/tuner.md). `tune_validation()` tunes
a sliding-window evaluator on its own (`FastTraining`'s ``evaluator="tune"``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

import torch
from ignite import distributed as idist

from monai_fast.distributed.comm import allreduce_seconds
from monai_fast.openmp import main_thread_core, on_core
from monai_fast.telemetry import device_description
from monai_fast.telemetry.memory import DeviceMemory, is_out_of_memory
from monai_fast.tune.measure import time_inference, time_training_step
from monai_fast.tune.result import MIB, TuneResult, layout_name, model_signature
from monai_fast.tune.search import Trial, best_over, peak_over_budget
from monai_fast.tune.space import SearchSpace
from monai_fast.tune.store import TuneStore, default_store_path

__all__ = ["SearchSpace", "TuneResult", "Tuner", "TuningError", "model_signature", "tune_validation"]

logger = logging.getLogger("monai_fast.tune")


class TuningError(RuntimeError):
    """A trial failed for a reason other than memory (on any rank); the message names the candidate."""


def agree_on_trial(oom: bool, over: bool, error: bool, peak: int, seconds: float) -> dict:
    """Max over ranks of the flags, the peak memory and the step time (a no-op for one process)."""
    if idist.get_world_size() == 1:
        return {"oom": oom, "over": over, "error": error, "peak": peak, "seconds": seconds}
    secs = seconds if math.isfinite(seconds) else 0.0  # NaN on failed ranks
    t = torch.tensor([float(oom), float(over), float(error), float(peak), secs], dtype=torch.float64)
    t = idist.all_reduce(t, op="MAX")
    return {"oom": t[0] > 0, "over": t[1] > 0, "error": t[2] > 0, "peak": int(t[3]), "seconds": float(t[4])}


def gather_errors(error: BaseException | None) -> str:
    """Every rank's error of this trial, one ``rank N: Type: message`` each, joined by ``; ``."""
    mine = "" if error is None else f"rank {idist.get_rank()}: {type(error).__name__}: {error}"
    if idist.get_world_size() == 1:
        return mine
    return "; ".join(m for m in idist.all_gather(mine) if m)


class Tuner:
    """Search training batch size, sliding-window batch, validation device and precision.

    Args:
        network: the model; a private copy is tuned, the original's weights are not touched.
        loss_function: training loss taking ``(prediction, label map)``; ``None`` for `run_validation()`.
        optimizer_factory: builds the copy's optimizer, e.g. ``lambda p: Novograd(p, 2e-3)``; ``None`` likewise.
        patch_size: training patch and sliding-window ROI.
        val_shape: spatial size of a typical validation volume.
        device: where training runs.
        num_samples: patches per volume (a batch size ``b`` means ``b * num_samples`` patches).
        in_channels: image channels.
        out_channels: classes.
        space: what to search (`SearchSpace`).
        memory_cap_mib: most memory a candidate may use; default the GPU's, or on a CPU RSS plus available RAM.
        overlap: sliding-window overlap.
        warmup: untimed iterations per trial.
        min_iters: fewest timed iterations per trial (their median is the trial's time).
        min_time_s: fewest seconds of timed iterations per trial.
        memory_format: the weights' layout at a precision, as the recipe trains them; ``None``: as given.
    """

    def __init__(
        self,
        network: torch.nn.Module,
        loss_function: Callable | None,
        optimizer_factory: Callable[..., torch.optim.Optimizer] | None,
        patch_size: Sequence[int],
        val_shape: Sequence[int],
        device: str | torch.device = "cpu",
        num_samples: int = 1,
        in_channels: int = 1,
        out_channels: int = 2,
        space: SearchSpace | None = None,
        memory_cap_mib: float | None = None,
        overlap: float = 0.25,
        warmup: int = 1,
        min_iters: int = 3,
        min_time_s: float = 0.5,
        memory_format: Callable[[str], torch.memory_format] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.memory = DeviceMemory(self.device)  # raises for CUDA without a GPU
        self.patch_size = tuple(int(s) for s in patch_size)
        self.val_shape = tuple(int(s) for s in val_shape)
        if len(self.patch_size) != 3 or len(self.val_shape) != 3:
            raise ValueError(f"patch_size and val_shape need three sizes, got {self.patch_size} and {self.val_shape}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if memory_cap_mib is not None and not memory_cap_mib > 0:
            raise ValueError(f"memory_cap_mib must be > 0, got {memory_cap_mib}")
        if warmup < 0 or min_iters < 1 or min_time_s < 0:
            raise ValueError("need warmup >= 0, min_iters >= 1 and min_time_s >= 0")
        self.space = space or SearchSpace()
        val_devices = self.space.val_devices
        if val_devices is None:
            val_devices = [str(self.device)] + (["cpu"] if self.device.type == "cuda" else [])
        self.val_devices = [torch.device(d) for d in val_devices]
        for d in self.val_devices:
            if d.type not in ("cpu", self.device.type):
                raise ValueError(f"val_devices may hold the training device or 'cpu', got {d}")
        if "fp16" in self.space.precisions and self.device.type != "cuda":
            raise ValueError("precision 'fp16' needs a CUDA device; use 'bf16' or 'fp32' on a CPU")
        self.source_network, self.loss_function, self.optimizer_factory = network, loss_function, optimizer_factory
        self.num_samples, self.in_channels, self.out_channels = num_samples, in_channels, out_channels
        self.memory_cap_mib, self.overlap, self.memory_format = memory_cap_mib, overlap, memory_format
        self.timing = {"warmup": warmup, "min_iters": min_iters, "min_time_s": min_time_s}
        self._on_trial: Callable[[dict], None] | None = None

    def key(self) -> str:
        """Cache key: device, its memory, model, shapes, search space and world size."""
        s = self.space
        parts = [
            device_description(self.device).split(" (")[0],
            f"mem={self.memory.total_bytes() // MIB}MiB",
            f"cap={self.memory_cap_mib or 'auto'}",
            model_signature(self.source_network),
            f"patch={'x'.join(map(str, self.patch_size))}",
            f"samples={self.num_samples}",
            f"val={'x'.join(map(str, self.val_shape))}",
            f"batch={s.batch_range[0]}-{s.batch_range[1]}",
            f"sw={s.sw_batch_range[0]}-{s.sw_batch_range[1]}",
            f"prec={','.join(s.precisions)}",
            f"valdev={','.join(str(d) for d in self.val_devices)}",
            f"world={idist.get_world_size()}",
        ]
        if self.memory_format:
            parts.append(f"layout={','.join(layout_name(self.memory_format(p)) for p in s.precisions)}")
        return "|".join(parts)

    def most_trials(self) -> int:
        """Most trials `run()` makes: `SearchSpace.most_runs()` per precision and per validation device."""
        s = self.space
        return len(s.precisions) * s.most_runs(s.batch_range) + len(self.val_devices) * s.most_runs(s.sw_batch_range)

    def run(self, progress: bool = False, on_trial: Callable[[dict], None] | None = None) -> TuneResult:
        """Run the searches and return the pick; out-of-memory candidates are infeasible, never raised.

        Args:
            progress: a progress bar over the trials (on a terminal only).
            on_trial: called with each trial's record (as in `TuneResult.trials`) as the trial ends.

        Raises:
            TuningError: a trial failed for another reason on any rank, or not even the smallest batch fits.
        """
        self._on_trial = on_trial
        with self._session(progress) as started:
            records, best_train = best_over(
                self.space.precisions,
                lambda p: lambda b: self._train_trial(b, p),
                self.space.batch_range,
                lambda p: {"phase": "train", "precision": p, "val_device": ""},
                self.space,
                partial(peak_over_budget, budget_bytes=self._budget),
            )
            if best_train is None:
                raise TuningError(
                    f"no training batch size in {self.space.batch_range} fits in the budget of "
                    f"{self._budget / MIB:.0f} MiB on {self.device}: "
                    + "; ".join(f"{r['value']}: {r['reason']}" for r in records)
                )
            precision, train_pick = best_train
            val_records, best_val = self._validation_phase(precision)
        return self._result(self.key(), precision, started, records + val_records, best_val, train_pick)

    def run_validation(self, precision: str, progress: bool = False) -> TuneResult:
        """Search only the sliding-window batch and stitching device, for a network trained at ``precision``.

        The result's training fields are empty (``batch_size`` 0); ``loss_function`` and ``optimizer_factory``
        may be ``None``.

        Raises:
            TuningError: as `run()`; also for ``precision`` outside the search space's.
        """
        if precision not in self.space.precisions:
            raise TuningError(f"precision {precision!r} is not in the search space's {list(self.space.precisions)}")
        self._on_trial = None
        with self._session(progress) as started:
            records, best_val = self._validation_phase(precision)
        return self._result(self.key() + "|validation-only", precision, started, records, best_val, None)

    def _result(
        self,
        key: str,
        precision: str,
        started: float,
        trials: list[dict],
        best_val: tuple[torch.device, Trial],
        train_pick: Trial | None,
    ) -> TuneResult:
        """The searches' picks as a `TuneResult`; without ``train_pick`` its training fields are empty."""
        return TuneResult(
            key=key,
            device=device_description(self.device),
            batch_size=train_pick.value if train_pick else 0,
            sw_batch_size=best_val[1].value,
            val_device=str(best_val[0]),
            precision=precision,
            train_samples_per_s=float(train_pick.throughput) if train_pick else 0.0,  # type: ignore[arg-type]
            val_volumes_per_s=float(best_val[1].throughput),  # type: ignore[arg-type]
            budget_mib=self._budget / MIB,
            leak_mib=self._leak / MIB,
            tuning_s=time.perf_counter() - started,
            trials=trials,
        )

    @contextlib.contextmanager
    def _session(self, progress: bool) -> Iterator[float]:
        """The private network copy, its optimizer, the budget and the progress bar of one search."""
        started = time.perf_counter()
        self.memory.release()
        self._after_first: int | None = None
        self._leak = 0
        self._budget = self.space.budget_bytes(self.memory, self.memory_cap_mib)
        self._net = copy.deepcopy(self.source_network).to(self.device)
        self._opt = self.optimizer_factory(self._net.parameters()) if self.optimizer_factory is not None else None
        # seconds of one gradient all-reduce (0 for one process): added to every step under DDP
        self._allreduce_s = allreduce_seconds(sum(p.numel() for p in self._net.parameters()))
        from monai_fast.progress import progress_bar

        self._bar = progress_bar(desc="tune", unit="trial", leave=False, enabled=progress and idist.get_rank() == 0)
        try:
            yield started
        finally:
            self._bar.close()
            del self._net, self._opt
            self.memory.release()

    def _validation_phase(self, precision: str) -> tuple[list[dict], tuple[torch.device, Trial]]:
        self._set_layout(precision)
        records, best = best_over(
            self.val_devices,
            lambda v: lambda s: self._val_trial(s, v, precision),
            self.space.sw_batch_range,
            lambda v: {"phase": "val", "precision": precision, "val_device": str(v)},
            self.space,
            partial(peak_over_budget, budget_bytes=self._budget),
        )
        if best is None:
            raise TuningError(
                f"no sliding-window batch in {self.space.sw_batch_range} fits in the budget of "
                f"{self._budget / MIB:.0f} MiB for a {self.val_shape} volume on {self.device}"
            )
        return records, best

    def _set_layout(self, precision: str) -> None:
        """Put the copy's weights in the layout the recipe trains at ``precision`` (in place)."""
        if self.memory_format is not None:
            self._net.to(memory_format=self.memory_format(precision))

    def _train_trial(self, batch: int, precision: str) -> Trial:
        patches = batch * self.num_samples
        self._bar.set_description(f"tune train batch_size={batch} ({precision})")
        self._set_layout(precision)
        return self._trial(
            batch,
            lambda: time_training_step(
                self._net,
                self.loss_function,
                self._opt,
                patches,
                self.patch_size,
                self.in_channels,
                self.out_channels,
                self.device,
                precision,
                **self.timing,
            ),
            per_step=patches * idist.get_world_size(),
            reduce_s=self._allreduce_s,
            labels={"phase": "train", "precision": precision, "val_device": ""},
        )

    def _val_trial(self, sw_batch: int, val_device: torch.device, precision: str) -> Trial:
        self._bar.set_description(f"tune val sw_batch_size={sw_batch} ({val_device})")
        return self._trial(
            sw_batch,
            lambda: time_inference(
                self._net,
                self.patch_size,
                sw_batch,
                self.val_shape,
                self.in_channels,
                self.device,
                val_device,
                precision,
                self.overlap,
                **self.timing,
            ),
            per_step=1,
            reduce_s=0.0,
            labels={"phase": "val", "precision": precision, "val_device": str(val_device)},
        )

    def _trial(self, value: int, measure: Callable[[], float], per_step: int, reduce_s: float, labels: dict) -> Trial:
        """Run ``measure`` once as a trial of ``value``, agreed on by all ranks and reported to ``on_trial``."""
        t0 = time.perf_counter()
        seconds, oom, error = float("nan"), False, None
        with self.memory.peak() as peak:
            try:
                with on_core(main_thread_core()):  # OpenMP's workers pinned: the main thread's trial on the free core
                    seconds = measure()
            except Exception as exc:  # noqa: BLE001 - sorted below, re-raised unless out of memory
                if is_out_of_memory(exc):
                    oom = True
                else:
                    error = exc
                del exc  # its traceback holds the trial's tensors
        if self._opt is not None:
            self._opt.zero_grad(set_to_none=True)
        self.memory.release(full=oom or error is not None)  # a full collection costs ~0.2 s per trial
        live = self.memory.live_bytes()
        if self._after_first is None:  # the model copy and optimizer state exist from here on
            self._after_first = live
        self._leak = max(self._leak, live - self._after_first)
        peak_b = peak.peak_bytes
        over = not oom and error is None and peak_b > self._budget
        # every rank reaches this point once per trial, whatever happened: agree on the outcome
        flags = agree_on_trial(oom, over, error is not None, peak_b, seconds)
        if flags["error"]:
            messages = gather_errors(error)
            raise TuningError(f"trial {value} failed (not out of memory): {messages}") from error
        self._bar.update(1)
        cost = time.perf_counter() - t0
        peak_mib = flags["peak"] / MIB
        if flags["oom"]:
            trial = Trial(value, False, None, None, "out of memory", cost)
        elif flags["over"]:
            trial = Trial(
                value, False, None, peak_mib, f"peak {peak_mib:.0f} MiB > budget {self._budget / MIB:.0f} MiB", cost
            )
        else:
            trial = Trial(value, True, per_step / (flags["seconds"] + reduce_s), peak_mib, "", cost)
        if self._on_trial is not None:
            self._on_trial(dict(trial.to_dict(), **labels))
        return trial


def tune_validation(
    network: torch.nn.Module,
    roi_size: Sequence[int],
    val_shape: Sequence[int],
    device: str | torch.device,
    precision: str,
    overlap: float = 0.25,
    in_channels: int = 1,
    sw_batch_range: tuple[int, int] = (1, 32),
    store: TuneStore | str | os.PathLike | None = "default",
    force: bool = False,
    progress: bool = False,
    **timing: float,
) -> TuneResult:
    """The fastest ``sw_batch_size`` and stitching device for ``network`` on ``val_shape`` volumes, timed with
    MONAI's ``sliding_window_inference`` and kept in the tuning store.

    Args:
        network: the evaluator's network (a private copy is timed; DDP wrappers looked through).
        roi_size: the sliding window's ROI.
        val_shape: spatial size of a typical validation volume (as the evaluator sees it).
        device: where the network runs.
        precision: the evaluator's precision (``"fp32"``, ``"bf16"``, ``"fp16"``).
        overlap: the window overlap.
        in_channels: image channels.
        sw_batch_range: inclusive range of windows per forward pass to search.
        store: a `TuneStore`, a path to one, ``"default"`` (`default_store_path()`) or ``None`` (no caching).
        force: tune again even when the store holds a result.
        progress: a progress bar over trials.
        **timing: ``warmup``, ``min_iters``, ``min_time_s`` per trial (default 1, 2, 0.3 s).

    Returns:
        A `TuneResult` whose ``sw_batch_size``, ``val_device`` and ``val_volumes_per_s`` are measured.

    Raises:
        TuningError: a trial failed for a reason other than memory, or not even one window fits.
    """
    timing = {"warmup": 1, "min_iters": 2, "min_time_s": 0.3, **timing}
    tuner = Tuner(
        getattr(network, "module", network),
        None,
        None,
        patch_size=roi_size,
        val_shape=val_shape,
        device=device,
        in_channels=in_channels,
        space=SearchSpace(precisions=[precision], sw_batch_range=sw_batch_range),
        overlap=overlap,
        **timing,
    )
    if store is not None and not isinstance(store, TuneStore):
        store = TuneStore(default_store_path() if store == "default" else store)
    key = tuner.key() + f"|overlap={overlap:g}|validation-only"
    if store is not None and not force:
        cached = store.get(key)
        if cached is not None:
            logger.info("validation tuning: using the cached result from %s", store.path)
            return cached
    result = replace(tuner.run_validation(precision, progress=progress), key=key)
    if store is not None:
        store.put(result)
    return result
