"""The run record's rows and how they are read: the one contract between the handlers that write and the reports.

Each row has a ``kind`` (`Kind`), a ``source`` (`Source`), the ``rank``, the ``engine``, the run ``segment`` and
the wall-clock ``time``, plus the handler's fields; ``FastTraining``'s event rows carry a ``lever`` (`Lever`).
Nothing here imports torch or a hardware library.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any

from monai_fast.telemetry.spans import Category

__all__ = [
    "KINDS",
    "RECORD_NAME",
    "Category",
    "Kind",
    "Lever",
    "Source",
    "data_share",
    "jsonable",
    "load_record",
    "load_summary",
    "record_files",
    "select",
]

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


KINDS = tuple(k.value for k in Kind)
#: the name of a rank's record file; nothing else in a run folder is read as a record
RECORD_NAME = re.compile(r"record\.rank(\d+)\.jsonl")


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
    kind, source = jsonable(kind), jsonable(source)
    return [
        r
        for r in rows
        if (kind is None or r.get("kind") == kind)
        and (source is None or r.get("source") == source)
        and (engine is None or r.get("engine", "train") == engine)
        and (rank is None or r.get("rank") == rank)
        and (segment is None or r.get("segment", 0) == segment)
    ]


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
