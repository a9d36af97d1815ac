"""Writing the run record: `RunRecord` streams one rank's rows and summaries into its run folder.

Segments, the folder's lock and a full file system: docs/monitoring.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ignite.distributed as idist

from monai_fast.files import NoSpaceError, no_space_in, write_json
from monai_fast.folders import RunFolderLock
from monai_fast.telemetry.record import KINDS, Kind, Lever, Source, SpanWriter, jsonable, load_summary

__all__ = ["EngineRecord", "RunRecord", "record_lock"]

logger = logging.getLogger("monai_fast.telemetry")

#: how much of an existing record's end is read to find its last segment
_TAIL_BYTES = 1 << 16


class RunRecord(SpanWriter):
    """Rows and summaries of one run on one rank, streamed to the run folder.

    Rows are appended to ``record.rank<R>.jsonl`` as they are added (without a folder they are kept in `rows`),
    summaries written atomically to ``summary.rank<R>.json`` at `close()`. A record already in the folder is
    continued as the next segment, never erased; the rank's folder lock is held until `close()`. A full file
    system is not raised: see `disk_full`.

    Args:
        run_dir: the run folder (created; must be writable). ``None``: in memory only.
        rank: this process's rank.
        flush_every: rows buffered before they are written; 1 writes each row as it is added.

    Raises:
        PermissionError: if ``run_dir`` cannot be written, naming it.
        monai_fast.folders.RunFolderBusyError: if another process writes this rank's record in ``run_dir``.

    Example:
        >>> rec = RunRecord("runs/exp1", rank=0)
        >>> with rec.span("setup"):
        ...     datasets = build_datasets()
        >>> rec.close()
    """

    def __init__(self, run_dir: str | os.PathLike | None, rank: int = 0, flush_every: int = 1) -> None:
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
        #: this record object's mark in its ``segment_started`` rows, telling it apart from a later run's
        self.writer = secrets.token_hex(6)
        self._file: Any = None
        self._events: dict[tuple[str, str], dict] = {}  # (source, lever) -> the latest fast_training-style event
        self._trainer_thread = threading.get_ident()  # until a run starts: the thread that made the record
        self._folder_lock: RunFolderLock | None = None
        self._end = 0  # bytes of whole rows in the record file
        self._last_iteration: int | None = None  # the trainer's last iteration in a row written to the file
        #: why this rank records no more rows in the current segment (its file system filled), else ``None``
        self.disk_full: NoSpaceError | None = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(self.run_dir, os.W_OK):
                raise PermissionError(f"run folder {self.run_dir} is not writable")
            self._folder_lock = record_lock(self.run_dir, rank).acquire()
            self.path = self.run_dir / f"record.rank{rank}.jsonl"
            last = _last_segment(self.path)
            self._segment = 0 if last is None else last + 1  # a record already here: continue it
            summary = load_summary(self.run_dir / f"summary.rank{rank}.json")
            self.summary = {k: v for k, v in summary.items() if k not in ("rank", "segments")}
            self._open()

    def _open(self) -> None:
        """Open the record file for appending; a row cut short at its end (a killed writer) is removed first."""
        assert self.run_dir is not None
        if self.path.is_file():
            with open(self.path, "r+b") as f:
                start, tail = _tail(f)
                if tail and not tail.endswith(b"\n"):
                    cut = tail.rfind(b"\n")
                    keep = start + cut + 1 if cut >= 0 else (0 if start == 0 else start + len(tail))
                    if keep < start + len(tail):
                        logger.warning(
                            "%s: its last row was cut short (its writer stopped while writing it); removed", self.path
                        )
                        f.truncate(keep)
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - held open until close()
        self._end = os.fstat(self._file.fileno()).st_size

    @property
    def segment(self) -> int:
        """The current run segment: one more than the record's last (0 for a new record) at first."""
        return self._segment

    def begin_segment(self) -> int:
        """Start recording a run of the engines (a ``trainer.run()``); returns its segment number.

        The first call starts the segment the record opened with; later calls reopen a closed record (its lock
        taken again, a full file system tried again) as one more segment. Either way a ``segment_started`` event
        is written, and the calling thread is the trainer's from now on.

        Raises:
            monai_fast.folders.RunFolderBusyError: another process took the run folder since `close()`.
        """
        with self._lock:
            if self._closed and self._folder_lock is not None:
                self._folder_lock.acquire()
                self._open()
                self.disk_full = None
            self._trainer_thread = threading.get_ident()
            if self._started:
                self._segment += 1
                self._closed = False
            self._started = True
            segment = self._segment
        self.add(
            Kind.EVENT,
            Source.RECORD,
            what="segment_started",
            pid=os.getpid(),
            host=socket.gethostname(),
            writer=self.writer,
            world_size=idist.get_world_size(),  # so the doctor can name a rank whose record is missing or empty
        )
        return segment

    def add(self, kind: Kind | str, source: Source | str, **fields: Any) -> dict:
        """Append one row; safe from any thread. Rows are dropped (one warning) after `close()` until
        `begin_segment()`, and once the file system filled (`disk_full`)."""
        kind, source = jsonable(kind), jsonable(source)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        row = {
            "kind": kind,
            "source": source,
            "rank": self.rank,
            "segment": self._segment,
            "time": time.time(),
            **fields,
        }
        with self._lock:
            if self._closed:
                if not self._warned_closed:
                    self._warned_closed = True
                    logger.warning("run record %s is closed; a %s row from %s was dropped", self.run_dir, kind, source)
                return row
            if kind == Kind.EVENT.value and "lever" in fields:
                self._events[(source, str(fields["lever"]))] = row
            if self.run_dir is None:
                self.rows.append(row)
            elif self.disk_full is None:  # streamed, not kept: a run of days must not grow in memory
                self._pending.append(row)
                if len(self._pending) >= self.flush_every:
                    self._flush_locked()
        return row

    def lever(self, source: Source | str, lever: Lever | str) -> dict | None:
        """The latest event row of ``source`` about ``lever`` (e.g. ``FastTraining``'s `Lever.DATA`), or ``None``."""
        with self._lock:
            return self._events.get((jsonable(source), lever))

    def on_critical_thread(self) -> bool:
        """Whether the calling thread runs the trainer (or made the record, before the first run)."""
        return threading.get_ident() == self._trainer_thread

    def set_summary(self, source: Source | str, values: dict) -> None:
        """Set the summary section of ``source`` (replacing an earlier one)."""
        with self._lock:
            self.summary[jsonable(source)] = values

    def flush(self) -> None:
        """Write the buffered rows to the file."""
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._file is None or not self._pending:
            return
        rows, self._pending = self._pending, []
        lines = [(json.dumps(jsonable(row)) + "\n").encode("utf-8") for row in rows]
        data = b"".join(lines)
        written = 0
        try:
            while written < len(data):  # unbuffered: in the kernel once written, a SIGKILL after this loses nothing
                written += self._file.write(data[written:])
        except OSError as err:
            full = no_space_in(err, self.path)
            if full is None:  # another write error: no half row left in the file, the rows kept to write again
                with contextlib.suppress(OSError):
                    os.ftruncate(self._file.fileno(), self._end)
                self._pending = rows + self._pending
                raise
            self._stop_on_full_disk(full, rows, lines, written)
            return
        self._kept(rows, len(data))

    def _kept(self, rows: list[dict], size: int) -> None:
        """Count ``rows`` (``size`` bytes) as written whole: the file's end, and the trainer's last iteration."""
        self._end += size
        for row in rows:
            if row.get("engine", "train") == "train" and isinstance(row.get("iteration"), int):
                self._last_iteration = row["iteration"]

    def _stop_on_full_disk(self, err: NoSpaceError, rows: list[dict], lines: list[bytes], written: int) -> None:
        """Keep the rows that went in whole, cut off the rest, close the file and warn once."""
        whole, size = 0, 0
        while whole < len(lines) and size + len(lines[whole]) <= written:
            size += len(lines[whole])
            whole += 1
        self._kept(rows[:whole], size)
        with contextlib.suppress(OSError):
            os.ftruncate(self._file.fileno(), self._end)  # the file ends with its last whole row
        with contextlib.suppress(OSError):
            self._file.close()
        self._file = None
        ends = "" if self._last_iteration is None else f" at the trainer's iteration {self._last_iteration}"
        self.disk_full = NoSpaceError(
            self.path,
            needed=sum(len(line) for line in lines[whole:]),
            free=err.free,  # measured at the error, before the cut frees a little
            what="run record",
            code=err.errno or errno.ENOSPC,
            detail=f"the record keeps its whole rows and ends{ends} (segment {self._segment}); rank {self.rank} "
            "records no more rows in this run, which goes on",
        )
        logger.warning("%s", self.disk_full)

    def close(self, **fields: Any) -> None:
        """End the segment: a ``segment_ended`` event (with ``fields``), the rows flushed, the summary written and
        the folder's lock given back. Idempotent."""
        if not self._closed and self._started:
            self.add(Kind.EVENT, Source.RECORD, what="segment_ended", **fields)
        with self._lock:
            if self._closed:
                return
            self._flush_locked()
            self._closed = True
            if self.run_dir is None:
                return
            if self._file is not None:
                self._file.close()
                self._file = None
            summary = self.run_dir / f"summary.rank{self.rank}.json"
            try:
                write_json(jsonable({"rank": self.rank, "segments": self._segment + 1, **self.summary}), summary)
            except NoSpaceError as err:  # the rows carry every number; the run goes on without the summary
                logger.warning("run summary not written: %s", err)
            finally:
                if self._folder_lock is not None:
                    self._folder_lock.release()


def record_lock(run_dir: str | os.PathLike, rank: int = 0, what: str | None = None) -> RunFolderLock:
    """The lock that owns ``run_dir`` for ``rank``'s record (``.monai-fast.rank<R>.lock``), not yet taken.

    `RunRecord` takes it; a command that does set-up work first (``monai-fast train``) takes it at its start, so a
    second run into the folder stops before that work. Taking it again in the same process is counted, not refused.
    """
    return RunFolderLock(run_dir, what=what or f"the run record of rank {rank}", name=f".monai-fast.rank{rank}.lock")


def _last_segment(path: Path) -> int | None:
    """The segment of the last complete row of an existing record file (``None``: no such file or row)."""
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        start, tail = _tail(f)
    lines = tail.split(b"\n")
    for line in reversed(lines[1:] if start > 0 else lines):  # the first may be cut by the seek
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("segment"), int):
            return row["segment"]
    return None


def _tail(f: Any) -> tuple[int, bytes]:
    """The last `_TAIL_BYTES` of the open binary file ``f``, and the offset they start at."""
    start = max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES)
    f.seek(start)
    return start, f.read()


class EngineRecord(SpanWriter):
    """A `RunRecord` as one engine writes to it: every row is stamped with the engine's name.

    Summaries of engines other than ``"train"`` go under ``"<source>.<engine>"`` (``"throughput.validation"``).
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
        """`RunRecord.add()` with ``engine=`` this engine's name."""
        return self.record.add(kind, source, engine=self.engine, **fields)

    def on_critical_thread(self) -> bool:
        """`RunRecord.on_critical_thread()`."""
        return self.record.on_critical_thread()

    def lever(self, source: Source | str, lever: Lever | str) -> dict | None:
        """`RunRecord.lever()`."""
        return self.record.lever(source, lever)

    def set_summary(self, source: Source | str, values: dict) -> None:
        """`RunRecord.set_summary()` under this engine's section."""
        name = jsonable(source)
        self.record.set_summary(name if self.engine == "train" else f"{name}.{self.engine}", values)
