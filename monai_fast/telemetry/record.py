"""The per-run record: every monai-fast handler writes its rows here; the doctor reads only this.

One record per run and rank. Rows have a ``kind`` (``iteration``, ``interval``, ``epoch`` or
``event``), a ``source`` (the handler), the ``rank`` and wall-clock ``time`` plus the handler's
fields. They are appended to ``record.rank<R>.jsonl`` in the run folder (flushed every
``flush_every`` rows and at close), and each handler's summary goes into
``summary.rank<R>.json``, written atomically at close. Nothing here imports torch or any
hardware library, so a record made on a GPU cluster can be read on a laptop.

Example:
    >>> from monai_fast.telemetry.record import RunRecord, load_record
    >>> rec = RunRecord("/tmp/run1")
    >>> rec.add("epoch", "time_breakdown", epoch=1, data_s=0.2, compute_s=3.1)
    >>> rec.set_summary("time_breakdown", {"data_share": 0.06})
    >>> rec.close()
    >>> rows, summary = load_record("/tmp/run1")
    >>> rows[0]["data_s"], summary["time_breakdown"]["data_share"]
    (0.2, 0.06)
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from monai_fast.files import write_json

__all__ = ["KINDS", "RunRecord", "load_record"]

KINDS = ("iteration", "interval", "epoch", "event")


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    item = getattr(v, "item", None)  # numpy / torch scalars
    return item() if callable(item) else str(v)


class RunRecord:
    """Rows and summaries of one run on one rank, streamed to the run folder.

    With a run folder, rows are appended to the file and not kept in memory (a run of days must
    not grow); without one (``run_dir=None``) they are kept in :attr:`rows`.

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
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.run_dir, os.W_OK):
                raise PermissionError(f"run folder {self.run_dir} is not writable")
            self.path = self.run_dir / f"record.rank{rank}.jsonl"
            self.path.write_text("")  # a new run starts a new record

    def add(self, kind: str, source: str, **fields: Any) -> dict:
        """Append one row; safe to call from any thread."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        row = {"kind": kind, "source": source, "rank": self.rank, "time": time.time(), **fields}
        with self._lock:
            if self.run_dir is None:
                self.rows.append(row)
            elif not self._closed:  # streamed, not kept: a run of days must not grow in memory
                self._pending.append(row)
                if len(self._pending) >= self.flush_every:
                    self._flush_locked()
        return row

    def set_summary(self, source: str, values: dict) -> None:
        """Set the summary section of ``source`` (replacing an earlier one)."""
        with self._lock:
            self.summary[source] = values

    def flush(self) -> None:
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
            write_json(_jsonable({"rank": self.rank, **self.summary}), self.run_dir / f"summary.rank{self.rank}.json")


def load_record(run_dir: str | os.PathLike, rank: int | None = None) -> tuple[list[dict], dict]:
    """Read a run folder's record: all ranks' rows (or one rank's) and their summaries.

    Returns:
        ``(rows, summary)``; with several ranks, ``summary`` maps ``"rank<R>"`` to each summary,
        with one rank it is that rank's summary.

    Raises:
        FileNotFoundError: if the folder has no ``record.rank*.jsonl``, naming the folder.
        ValueError: for a line that is not JSON, naming file and line.
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
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i} is not a JSON row: {e}") from e
        r = p.name[len("record.rank") : -len(".jsonl")]
        s = run_dir / f"summary.rank{r}.json"
        summaries[f"rank{r}"] = json.loads(s.read_text()) if s.is_file() else {}
    summary = next(iter(summaries.values())) if len(summaries) == 1 else summaries
    return rows, summary
