"""The per-run record: the one contract between the handlers that write and the reports that read.

One record per run and rank. Each row has a ``kind`` (:class:`Kind`), a ``source`` (:class:`Source`:
which handler wrote it), the ``rank``, the ``engine`` it belongs to (``"train"``, ``"validation"``,
...), the run ``segment`` (a second ``trainer.run()`` on the same engines is segment 1, ...) and
the wall-clock ``time``, plus the handler's fields. Rows are appended to ``record.rank<R>.jsonl``
in the run folder (flushed every ``flush_every`` rows and at close); each handler's summary goes
into ``summary.rank<R>.json``, written atomically at close. Readers select rows with
:func:`select` and compute the data share with :func:`data_share`, so "which rows belong to which
engine, rank and run" is answered here only. Nothing here imports torch or a hardware library, so a
record made on a GPU cluster can be read on a laptop.

Example:
    >>> from monai_fast.telemetry.record import Kind, RunRecord, Source, load_record, select
    >>> rec = RunRecord("/tmp/run1")
    >>> _ = rec.add(Kind.EPOCH, Source.TIME_BREAKDOWN, engine="train", epoch=1, data_s=0.2, compute_s=3.1)
    >>> rec.set_summary(Source.TIME_BREAKDOWN, {"data_share": 0.06})
    >>> rec.close()
    >>> rows, summary = load_record("/tmp/run1")
    >>> [r["data_s"] for r in select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN, engine="train")]
    [0.2]
    >>> summary["time_breakdown"]["data_share"]
    0.06
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

from monai_fast.files import write_json
from monai_fast.telemetry.spans import Category, SpanWriter

__all__ = ["KINDS", "Category", "EngineRecord", "Kind", "RunRecord", "Source", "data_share", "load_record", "select"]

logger = logging.getLogger("monai_fast.telemetry")


class Kind(str, Enum):
    """What a row describes."""

    ITERATION = "iteration"  #: one training/validation step
    INTERVAL = "interval"  #: one sample of a background sampler (GPU)
    EPOCH = "epoch"  #: one epoch of an engine
    EVENT = "event"  #: something that happened once (a fallback, a run segment starting)
    SPAN = "span"  #: a stretch of wall-clock time of one Category (see monai_fast.telemetry.spans)


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


KINDS = tuple(k.value for k in Kind)


def data_share(data_s: float, compute_s: float) -> float:
    """Share of iteration time spent waiting for data: ``data / (data + compute)``, 0 when nothing was timed."""
    busy = data_s + compute_s
    return data_s / busy if busy > 0 else 0.0


def _value(v: Any) -> Any:
    return v.value if isinstance(v, Enum) else v


def select(
    rows: Iterable[dict],
    kind: Kind | str | None = None,
    source: Source | str | None = None,
    engine: str | None = None,
    rank: int | None = None,
    segment: int | None = None,
) -> list[dict]:
    """The rows that match every given criterion (``None`` matches anything).

    Rows written before the ``engine`` field existed count as ``"train"``; rows without a
    ``segment`` count as segment 0.
    """
    kind, source = _value(kind), _value(source)
    return [
        r
        for r in rows
        if (kind is None or r.get("kind") == kind)
        and (source is None or r.get("source") == source)
        and (engine is None or r.get("engine", "train") == engine)
        and (rank is None or r.get("rank") == rank)
        and (segment is None or r.get("segment", 0) == segment)
    ]


def _jsonable(v: Any) -> Any:
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    item = getattr(v, "item", None)  # numpy / torch scalars
    return item() if callable(item) else str(v)


class RunRecord(SpanWriter):
    """Rows and summaries of one run on one rank, streamed to the run folder.

    With a run folder, rows are appended to the file and not kept in memory (a run of days must
    not grow); without one (``run_dir=None``) they are kept in :attr:`rows`. Wall-clock spans
    (set-up, cache filling, ...) are written with :meth:`span` / :meth:`add_span`
    (:mod:`monai_fast.telemetry.spans`).

    Args:
        run_dir: the run folder (created; must be writable, checked here). ``None`` keeps the
            record in memory only.
        rank: this process's rank; default 0. The distributed layer passes ``idist.get_rank()``.
        flush_every: rows buffered before they are appended to the file.

    Raises:
        PermissionError: if ``run_dir`` cannot be written, naming it.
    """

    def __init__(self, run_dir: str | os.PathLike | None, rank: int = 0, flush_every: int = 256) -> None:
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = rank
        self.flush_every = flush_every
        self.rows: list[dict] = []
        self.summary: dict[str, Any] = {}
        self._pending: list[dict] = []
        self._lock = threading.Lock()
        self._closed = False
        self._warned_closed = False
        self._started = False
        self._segment = 0
        self._trainer_thread = threading.get_ident()  # until a run starts: the thread that made the record
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.run_dir, os.W_OK):
                raise PermissionError(f"run folder {self.run_dir} is not writable")
            self.path = self.run_dir / f"record.rank{rank}.jsonl"
            self.path.write_text("")  # a new run starts a new record

    @property
    def segment(self) -> int:
        """The current run segment: 0 for the first run, then one more for each :meth:`begin_segment`."""
        return self._segment

    def begin_segment(self) -> int:
        """Start recording a new run of the engines (a second ``trainer.run()``).

        The first call does nothing but mark the start; later calls reopen a closed record (rows
        are appended to the same file) and count one more segment. The calling thread is the
        trainer's from now on (spans from other threads are overlapped). Returns the segment number.
        """
        with self._lock:
            self._trainer_thread = threading.get_ident()
            if self._started:
                self._segment += 1
                self._closed = False
            self._started = True
            segment = self._segment
        self.add(Kind.EVENT, Source.RECORD, what="segment_started")
        return segment

    def add(self, kind: Kind | str, source: Source | str, **fields: Any) -> dict:
        """Append one row; safe to call from any thread. Rows added after :meth:`close` are dropped
        (with a warning, once) until :meth:`begin_segment` reopens the record."""
        kind, source = _value(kind), _value(source)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        row = {"kind": kind, "source": source, "rank": self.rank, "segment": self._segment, "time": time.time(), **fields}
        with self._lock:
            if self._closed:
                if not self._warned_closed:
                    self._warned_closed = True
                    logger.warning("run record %s is closed; a %s row from %s was dropped", self.run_dir, kind, source)
            elif self.run_dir is None:
                self.rows.append(row)
            else:  # streamed, not kept: a run of days must not grow in memory
                self._pending.append(row)
                if len(self._pending) >= self.flush_every:
                    self._flush_locked()
        return row

    def on_critical_thread(self) -> bool:
        """Whether the calling thread runs the trainer (or made the record, before the first run)."""
        return threading.get_ident() == self._trainer_thread

    def set_summary(self, source: Source | str, values: dict) -> None:
        """Set the summary section of ``source`` (replacing an earlier one)."""
        with self._lock:
            self.summary[_value(source)] = values

    def flush(self) -> None:
        """Append the buffered rows to the file."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self.run_dir is None or not self._pending:
            return
        with open(self.path, "a") as f:
            for row in self._pending:
                f.write(json.dumps(_jsonable(row)) + "\n")
        self._pending.clear()

    def close(self) -> None:
        """Flush rows and write the summary JSON atomically. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._flush_locked()
            self._closed = True
            if self.run_dir is None:
                return
            write_json(_jsonable({"rank": self.rank, "segments": self._segment + 1, **self.summary}),
                       self.run_dir / f"summary.rank{self.rank}.json")


class EngineRecord(SpanWriter):
    """A :class:`RunRecord` as one engine writes to it: every row is stamped with the engine's name.

    Summaries of the ``"train"`` engine are stored under their source's name, those of other
    engines under ``"<source>.<engine>"`` (e.g. ``"throughput.validation"``).
    """

    def __init__(self, record: RunRecord, engine: str) -> None:
        self.record, self.engine = record, engine

    @property
    def run_dir(self) -> Path | None:
        return self.record.run_dir

    @property
    def rank(self) -> int:
        return self.record.rank

    def add(self, kind: Kind | str, source: Source | str, **fields: Any) -> dict:
        """:meth:`RunRecord.add` with ``engine=`` this engine's name."""
        return self.record.add(kind, source, engine=self.engine, **fields)

    def on_critical_thread(self) -> bool:
        """:meth:`RunRecord.on_critical_thread`."""
        return self.record.on_critical_thread()

    def set_summary(self, source: Source | str, values: dict) -> None:
        """:meth:`RunRecord.set_summary` under this engine's section."""
        name = _value(source)
        self.record.set_summary(name if self.engine == "train" else f"{name}.{self.engine}", values)


def load_record(run_dir: str | os.PathLike, rank: int | None = None) -> tuple[list[dict], dict]:
    """Read a run folder's record: all ranks' rows (or one rank's) and their summaries.

    Returns:
        ``(rows, summary)``; with several ranks, ``summary`` maps ``"rank<R>"`` to each summary,
        with one rank it is that rank's summary.

    A summary file that is missing or damaged reads as empty, with a warning naming it: the rows
    alone carry every number the doctor needs.

    Raises:
        FileNotFoundError: if the folder has no ``record.rank*.jsonl``, naming the folder.
        ValueError: for a line that is not a JSON object, naming file and line.
    """
    run_dir = Path(run_dir)
    paths = sorted(run_dir.glob("record.rank*.jsonl")) if rank is None else [run_dir / f"record.rank{rank}.jsonl"]
    paths = [p for p in paths if p.is_file()]
    if not paths:
        raise FileNotFoundError(f"no monai-fast record (record.rank*.jsonl) in {run_dir}")
    rows: list[dict] = []
    summaries: dict[str, dict] = {}
    for p in paths:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i} is not a JSON row: {e}") from e
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{i} is not a record row (a JSON object): got {type(row).__name__}")
            rows.append(row)
        r = p.name[len("record.rank") : -len(".jsonl")]
        summaries[f"rank{r}"] = _load_summary(run_dir / f"summary.rank{r}.json")
    summary = next(iter(summaries.values())) if len(summaries) == 1 else summaries
    return rows, summary


def _load_summary(path: Path) -> dict:
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
