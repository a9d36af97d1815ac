"""Put a `RunRecord` on engines, where every handler finds it."""

from __future__ import annotations

import os
import sys
import time
from contextlib import AbstractContextManager
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.data import CacheDataset, PersistentDataset

from monai_fast.distributed.env import placement
from monai_fast.handlers.lifecycle import EngineHandler
from monai_fast.handlers.window_tune import sliding_window_of
from monai_fast.telemetry.chain import transform_names
from monai_fast.telemetry.precision import cpu_has_bf16_hardware
from monai_fast.telemetry.record import Category, Kind, Source
from monai_fast.telemetry.run_record import EngineRecord, RunRecord

__all__ = ["RecordHandler", "add_iteration_row", "add_row", "cached_dataset", "describe_engine", "record_of"]


def record_of(engine: Engine) -> EngineRecord | None:
    """The record attached to ``engine``, as that engine writes to it (``None`` without one)."""
    return getattr(engine.state, "run_record", None)


def add_row(engine: Engine, kind: Kind | str, source: Source | str, **fields: Any) -> None:
    """Add a row to the record attached to ``engine``; without a record (no `RecordHandler`), nothing."""
    if (record := record_of(engine)) is not None:
        record.add(kind, source, **fields)


def add_iteration_row(engine: Engine, source: Source | str, **fields: Any) -> None:
    """`add_row()` of an ``iteration`` row stamped with the engine's epoch and iteration."""
    add_row(engine, Kind.ITERATION, source, epoch=engine.state.epoch, iteration=engine.state.iteration, **fields)


def cached_dataset(engine: Engine) -> str | None:
    """The class name of ``engine``'s data set when it is a cache (MONAI's or `CropCacheDataset`), else ``None``."""
    from monai_fast.data.crop_cache import CropCacheDataset

    dataset = getattr(loader_of(engine), "dataset", None)
    return type(dataset).__name__ if isinstance(dataset, (CacheDataset, PersistentDataset, CropCacheDataset)) else None


def loader_of(engine: Engine) -> Any:
    """The loader ``engine`` reads: the one its run was given (``state.dataloader``), else a MONAI workflow's own."""
    return getattr(engine.state, "dataloader", None) or getattr(engine, "data_loader", None)


_CONVS = (
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.ConvTranspose1d,
    torch.nn.ConvTranspose2d,
    torch.nn.ConvTranspose3d,
)


def describe_engine(engine: Engine) -> dict[str, Any]:
    """What an engine runs, for the record: network, spatial dimensions, inferer, sliding window, amp, cache."""
    network = getattr(engine, "network", None)
    dims = None
    if isinstance(network, torch.nn.Module):  # the first convolution's (transposed or not) spatial dimensions
        convs = (m for m in network.modules() if isinstance(m, _CONVS))
        dims = next((len(m.kernel_size) for m in convs), None)
    inferer = getattr(engine, "inferer", None)
    window = sliding_window_of(inferer) if inferer is not None else None
    device = getattr(getattr(engine, "state", None), "device", None)  # a MONAI workflow's, None on a plain Engine
    loader = loader_of(engine)
    return {
        "network": type(network).__name__ if network is not None else None,
        "spatial_dims": dims,
        "inferer": type(inferer).__name__ if inferer is not None else None,
        "sliding_window": None if inferer is None else window is not None,
        "sw_batch_size": getattr(window, "sw_batch_size", None),
        "amp": getattr(engine, "amp", None),
        "device": None if device is None else str(device),
        "cpu_bf16": cpu_has_bf16_hardware() if device is not None and str(device).startswith("cpu") else None,
        "data_cached": cached_dataset(engine) is not None,
        "transforms": transform_names(getattr(getattr(loader, "dataset", None), "transform", None)),
    }


class RecordHandler(EngineHandler):
    """Creates the run's record and shares it with every monai-fast handler on the engines.

    Attach it to the trainer first, then the same instance to the evaluator. Each trainer run is a segment
    of the same file; a run folder another process writes raises `RunFolderBusyError`. Rows: docs/doctor.md.

    Args:
        run_dir: the run folder; ``None`` keeps the record in memory.
        rank: default ``idist.get_rank()``.

    Examples:
        >>> rec = RecordHandler("runs/exp1")
        >>> rec.attach(trainer); rec.attach(evaluator)  # doctest: +SKIP
    """

    multi_engine = True

    def __init__(self, run_dir: str | os.PathLike | None, rank: int | None = None) -> None:
        super().__init__()
        self.record = RunRecord(run_dir, rank=idist.get_rank() if rank is None else rank)
        self._names: dict[int, str] = {}
        self._pending_name: str | None = None
        self._started: dict[int, float] = {}  # engine id -> time.time() its current run started
        self._described: dict[int, int] = {}  # engine id -> the segment its engine row was written in

    @property
    def segment(self) -> int:
        """The record's current segment, carried by the rows of the trainer's latest run."""
        return self.record.segment

    def span(self, category: Category | str, **fields: Any) -> AbstractContextManager[None]:
        """`RunRecord.span()`: time a ``with`` block (your set-up: ``category="setup"``) into the run record."""
        return self.record.span(category, **fields)

    def attach(self, engine: Engine, name: str | None = None) -> None:
        """Share the record with ``engine`` (the trainer first: it owns the record, then its evaluators).

        Args:
            engine: the trainer (first), then its evaluator(s).
            name: the engine's name in the rows; default ``"train"`` for the first engine, else ``"validation"``.
        """
        self._pending_name = name
        super().attach(engine)

    def _attach(self, engine: Engine) -> None:
        taken = list(self._names.values())
        default = "validation" if "validation" not in taken else f"engine{len(taken)}"
        name = self._pending_name or (default if taken else "train")
        if name in taken:
            raise ValueError(f"RecordHandler: engine name {name!r} is taken; pass another name=")
        self._names[id(engine)] = name
        engine.state.run_record = EngineRecord(self.record, name)
        # first at STARTED, last at the run's end: the span covers the other handlers' work too
        self.on(engine, Events.STARTED, self._run_started, first=True)
        self.on_run_end(engine, self._run_ended, last=True)

    def _run_started(self, engine: Engine) -> None:
        if self.engine is engine:  # the owner: its runs are the record's segments
            self.record.begin_segment()
            self.record.add(Kind.EVENT, Source.RECORD, what="placement", **placement())
        if self._described.get(id(engine)) != self.record.segment:
            self._described[id(engine)] = self.record.segment
            described = describe_engine(engine)
            described.update(start_epoch=engine.state.epoch, start_iteration=engine.state.iteration)
            record_of(engine).add(Kind.EVENT, Source.RECORD, what="engine", **described)  # type: ignore[union-attr]
        self._started[id(engine)] = time.time()

    def _run_ended(self, engine: Engine) -> None:
        # a run that raised ends here inside ignite's except block; engine.terminate() is a normal end
        error = None if engine.should_terminate else sys.exc_info()[1]
        start = self._started.pop(id(engine), None)  # None: the second call for one run (TERMINATE, COMPLETED)
        owner = self.engine is engine
        if start is not None:
            category = Category.RUN if owner else Category.VALIDATION
            record_of(engine).add_span(category, start, max(time.time(), start), source=Source.RECORD)  # type: ignore[union-attr]
        if owner:
            raised = {} if error is None else {"raised": type(error).__name__}
            self.record.close(epoch=engine.state.epoch, iteration=engine.state.iteration, **raised)
        else:
            self.record.flush()

    def _detached(self, engine: Engine) -> None:
        self._names.pop(id(engine), None)
        if record_of(engine) is not None and record_of(engine).record is self.record:
            engine.state.run_record = None
        if not self.is_attached():
            self.record.close()
