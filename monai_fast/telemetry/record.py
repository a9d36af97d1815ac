"""The run record's rows and how they are read: the one contract between the handlers that write and the reports.

Each row has a ``kind`` (`Kind`), a ``source`` (`Source`), the ``rank``, the ``engine``, the run ``segment`` and
the wall-clock ``time``, plus the handler's fields; ``FastTraining``'s event rows carry a ``lever`` (`Lever`).
A ``span`` row is one stretch of work of one `Category` from ``start`` to ``end`` (``time.time()`` seconds); it is
``overlapped`` (listed apart, never in the shares) when written from a thread other than the trainer's, unless
``overlapped=`` says otherwise. Who writes which: docs/design.md. Nothing here imports torch or a hardware library.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Any

__all__ = [
    "DERIVED",
    "KINDS",
    "RECORDABLE",
    "RECORD_NAME",
    "Category",
    "Kind",
    "Lever",
    "Source",
    "SpanWriter",
    "data_share",
    "jsonable",
    "load_record",
    "load_summary",
    "record_files",
    "select",
    "wall_time",
]

logger = logging.getLogger("monai_fast.telemetry")


class Kind(str, Enum):
    """What a row describes."""

    ITERATION = "iteration"  #: one training/validation step
    INTERVAL = "interval"  #: one sample of a background sampler (GPU)
    EPOCH = "epoch"  #: one epoch of an engine
    EVENT = "event"  #: something that happened once (a fallback, a run segment starting)
    SPAN = "span"  #: a stretch of wall-clock time of one Category (see `SpanWriter`)


class Source(str, Enum):
    """Which part of monai-fast wrote a row or a summary."""

    RECORD = "record"
    TIME_BREAKDOWN = "time_breakdown"
    THROUGHPUT = "throughput"
    GPU = "gpu"
    AMP = "amp"
    KERNELS = "kernels"
    FAST_TRAINING = "fast_training"
    VALIDATION = "validation"  #: validation schedule decisions and background validations
    INFERENCE = "inference"  #: an evaluator run split into network and sliding-window time
    CHECKPOINT = "checkpoint"
    RECIPE = "recipe"
    USER = "user"
    TRAINING_ALGORITHM = "training_algorithm"  #: the trainer's own post-processing and metrics, timed per epoch


class Lever(str, Enum):
    """What a ``FastTraining`` event row (``lever=``) and ``FastTraining.applied`` are about, named as the option
    that sets it; its text is its value (``str(Lever.EVALUATOR) == "evaluator"``)."""

    DATA = "data"  #: the training set's cache and loader (options ``cache`` and ``loader``)
    PREFETCH = "prefetch"  #: the next training batch moved to the device ahead
    VALIDATION_DATA = "validation data"  #: the evaluator's cache and loader
    VALIDATION_PREFETCH = "validation prefetch"  #: the next validation batch moved to the device ahead
    PRECISION = "precision"
    MEMORY_FORMAT = "memory_format"
    COMPILE = "compile"  #: ``torch.compile`` of the trainer's network
    VALIDATION_COMPILE = "validation compile"  #: ``torch.compile`` of the network's calls in the evaluator
    PREDICTION_LAYOUT = "prediction_layout"
    EVALUATOR = "evaluator"  #: the evaluator's sliding-window settings

    def __str__(self) -> str:
        return self.value


class Category(str, Enum):
    """What a stretch of wall-clock time was spent on."""

    RUN = "run"  #: the frame: one run of the trainer (not a share of its own)
    SETUP = "setup"  #: building data sets, networks, engines before training
    CACHE_FILL = "cache_fill"  #: filling a cache (in RAM, GPU memory, on disk)
    DATA_WAIT = "data_wait"  #: the trainer waiting for its loader (from TimeBreakdown)
    COMPUTE = "compute"  #: the training step (from TimeBreakdown)
    VALIDATION = "validation"  #: a run of the evaluator
    CHECKPOINT = "checkpoint"  #: writing a checkpoint
    PAUSED = "paused"  #: between a run's segments while another run had its turn (a race's recipes take turns)
    HANDLERS = "handlers"  #: between iterations, in event handlers (derived)
    IDLE = "idle"  #: none of the above (derived)


#: categories derived by the doctor or taken from TimeBreakdown's rows, never written as spans
DERIVED = (Category.DATA_WAIT, Category.COMPUTE, Category.HANDLERS, Category.IDLE)
#: categories a span row may have
RECORDABLE = tuple(c.value for c in Category if c not in DERIVED)


KINDS = tuple(k.value for k in Kind)
#: the name of a rank's record file; nothing else in a run folder is read as a record
RECORD_NAME = re.compile(r"record\.rank(\d+)\.jsonl")
#: what a row without the field counts as
_ROW_DEFAULTS = {"engine": "train", "segment": 0}


def data_share(data_s: float, compute_s: float) -> float:
    """Share of iteration time spent waiting for data: ``data / (data + compute)``, 0 when nothing was timed."""
    busy = data_s + compute_s
    return data_s / busy if busy > 0 else 0.0


def select(
    rows: Iterable[dict],
    kind: Kind | str | None = None,
    source: Source | str | None = None,
    engine: str | None = None,
    rank: int | None = None,
    segment: int | None = None,
) -> list[dict]:
    """The rows that match every given criterion (``None`` matches anything).

    Rows without an ``engine`` count as ``"train"``, rows without a ``segment`` as segment 0.
    """
    criteria = {"kind": jsonable(kind), "source": jsonable(source), "engine": engine, "rank": rank, "segment": segment}
    wanted = {field: value for field, value in criteria.items() if value is not None}
    return [r for r in rows if all(r.get(f, _ROW_DEFAULTS.get(f)) == v for f, v in wanted.items())]


def jsonable(v: Any) -> Any:
    """``v`` as JSON can hold it: enums by value, containers item by item, numpy/torch scalars as numbers."""
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    item = getattr(v, "item", None)  # numpy / torch scalars
    return item() if callable(item) else str(v)


def record_files(run_dir: str | os.PathLike) -> tuple[dict[int, Path], list[Path]]:
    """The run's record files by rank, and the strays: files named like one (``record.rank0 (copy).jsonl``) but
    not exactly ``record.rank<R>.jsonl``, never read."""
    run_dir = Path(run_dir)
    ranks: dict[int, Path] = {}
    strays: list[Path] = []
    for p in sorted(run_dir.glob("record*.jsonl*")):
        if not p.is_file():
            continue
        m = RECORD_NAME.fullmatch(p.name)
        if m is None:
            strays.append(p)
        else:
            ranks[int(m.group(1))] = p
    return dict(sorted(ranks.items())), strays


def load_record(run_dir: str | os.PathLike, rank: int | None = None) -> tuple[list[dict], dict]:
    """Read a run folder's record: all ranks' rows (or one rank's) and their summaries.

    Only `record_files()`'s files are read (strays are named in a warning). A last line cut short (a rank killed
    while writing it) is left out, and a missing or damaged summary reads as empty, each with a warning.

    Returns:
        ``(rows, summary)``; with several ranks ``summary`` maps ``"rank<R>"`` to each summary.

    Raises:
        FileNotFoundError: if the folder has no ``record.rank<R>.jsonl``, naming it (and the run folders in it).
        ValueError: for a line that is not a JSON object, naming file and line.

    Example:
        >>> rows, summary = load_record("runs/demo/fast")
        >>> epochs = select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN, engine="train")
    """
    run_dir = Path(run_dir)
    files, strays = record_files(run_dir)
    if strays:
        logger.warning(
            "%s: not read, not a record file of the run (only record.rank<R>.jsonl are): %s",
            run_dir,
            ", ".join(p.name for p in strays),
        )
    if rank is not None:
        files = {rank: files[rank]} if rank in files else {}
    if not files:
        runs = sorted(d.name for d in run_dir.glob("*/") if rank is None and any(d.glob("record.rank*.jsonl")))
        held = (
            f"; it holds the records of {len(runs)} runs, one per folder: {', '.join(runs)}: name one" if runs else ""
        )
        raise FileNotFoundError(f"no monai-fast record (record.rank<R>.jsonl) in {run_dir}{held}")
    rows: list[dict] = []
    summaries: dict[str, dict] = {}
    for r, p in files.items():
        lines = p.read_text(encoding="utf-8", errors="replace").split("\n")
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if i == len(lines):  # no newline after it: the writer was killed mid-row
                    logger.warning("%s:%d: a row cut short (its writer stopped while writing it) is left out", p, i)
                    continue
                raise ValueError(f"{p}:{i} is not a JSON row: {e}") from e
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{i} is not a record row (a JSON object): got {type(row).__name__}")
            rows.append(row)
        summaries[f"rank{r}"] = load_summary(run_dir / f"summary.rank{r}.json")
    summary = next(iter(summaries.values())) if len(summaries) == 1 else summaries
    return rows, summary


def load_summary(path: Path) -> dict:
    """A rank's ``summary.rank<R>.json``; empty, with a warning naming it, when missing or damaged."""
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict):
            raise ValueError(f"top level is a {type(summary).__name__}, not an object")  # noqa: TRY004
    except (OSError, ValueError) as e:
        logger.warning("run summary %s is unreadable (%s); reading the rows without it", path, e)
        return {}
    return summary


def wall_time(perf_counter_value: float) -> float:
    """The ``time.time()`` reading for a past `time.perf_counter()` reading (e.g. a recipe's ``t0``)."""
    return time.time() - (time.perf_counter() - perf_counter_value)


def _category(category: Category | str) -> str:
    value = category.value if isinstance(category, Category) else category
    if value not in RECORDABLE:
        raise ValueError(
            f"span category must be one of {', '.join(RECORDABLE)} (data_wait, compute, handlers and idle "
            f"are derived by the doctor), got {category!r}"
        )
    return value


class SpanWriter(ABC):
    """The span API of the run record (the base of ``RunRecord`` and ``EngineRecord``, which implement `add()` and
    `on_critical_thread()`)."""

    @abstractmethod
    def add(self, kind: Any, source: Any, **fields: Any) -> dict:
        """Append one row of ``kind`` from ``source`` with ``fields``; returns the row as written."""

    @abstractmethod
    def on_critical_thread(self) -> bool:
        """Whether the calling thread is the one whose time is the run's critical path (the trainer's)."""

    def add_span(
        self,
        category: Category | str,
        start: float,
        end: float,
        source: Any = "user",
        overlapped: bool | None = None,
        **fields: Any,
    ) -> dict:
        """Record a span that is over: ``start`` and ``end`` are ``time.time()`` readings.

        Args:
            category: one of `RECORDABLE`.
            start, end: when it began and ended (``end >= start``); `wall_time()` converts a `time.perf_counter()`.
            source: who writes it (a ``Source``).
            overlapped: whether it ran beside training; ``None``: when written from another thread than the trainer's.
            fields: more fields of the row.

        Raises:
            ValueError: an unknown category, or ``end`` before ``start``, naming it.
        """
        value = _category(category)
        if not end >= start:
            raise ValueError(f"span {value!r}: end ({end}) is before start ({start})")
        if overlapped is None:
            overlapped = not self.on_critical_thread()
        return self.add(
            "span",
            source,
            category=value,
            start=float(start),
            end=float(end),
            duration_s=float(end - start),
            overlapped=bool(overlapped),
            **fields,
        )

    @contextmanager
    def span(
        self, category: Category | str, source: Any = "user", overlapped: bool | None = None, **fields: Any
    ) -> Iterator[None]:
        """Record the wall-clock time of a ``with`` block as a span (also when the block raises).

        Example:
            >>> with record.span("cache_fill", items=32):
            ...     dataset = CacheDataset(files, transform)
        """
        _category(category)  # a bad category fails before the work, not after it
        if overlapped is None:
            overlapped = not self.on_critical_thread()
        start = time.time()
        try:
            yield
        finally:
            self.add_span(category, start, max(time.time(), start), source=source, overlapped=overlapped, **fields)
