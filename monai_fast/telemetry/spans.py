"""Wall-clock spans: where a run's time went, as rows of the run record (``kind="span"``).

A span is one stretch of work of one `Category` from ``start`` to ``end`` (``time.time()`` seconds); it is
``overlapped`` (listed apart, never in the shares) when written from a thread other than the trainer's, unless
``overlapped=`` says otherwise. Who writes which: docs/design.md.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

__all__ = ["DERIVED", "RECORDABLE", "Category", "SpanWriter", "wall_time"]


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
