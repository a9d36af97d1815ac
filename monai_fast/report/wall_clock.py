"""Where a run's wall clock went, in categories whose shares sum to 100 %, overlapped work listed apart.

Every instant of each ``trainer.run()`` (and the set-up before it) goes to the most specific category at work
on the trainer's thread (the order: docs/doctor.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from monai_fast.report.ranks import segments
from monai_fast.telemetry.record import Category, Kind, Lever, Source, select

if TYPE_CHECKING:
    from monai_fast.report.applied import InEffect

__all__ = ["LABELS", "SHARES", "WallClock", "table_lines", "wall_clock", "wall_clock_advice"]

#: the categories of the critical path, in the order reports list them
SHARES = ("setup", "cache_fill", "compute", "data_wait", "validation", "checkpoint", "paused", "handlers", "idle")
LABELS = {
    "setup": "set-up",
    "cache_fill": "cache filling",
    "compute": "training compute",
    "data_wait": "waiting for data",
    "validation": "validation",
    "checkpoint": "checkpoints",
    "paused": "paused while another run had its turn",
    "handlers": "handlers between iterations",
    "idle": "idle",
}
_Span = tuple[float, float]  #: (start, end)
_Tagged = tuple[float, float, str]  #: (start, end, category)
#: who gets an instant claimed by several categories: the first in this order
_PRIORITY = ("checkpoint", "validation", "cache_fill", "data_wait", "compute", "setup", "paused", "handlers", "idle")


@dataclass
class WallClock:
    """One rank's wall clock: ``seconds`` per category of the critical path (summing to ``total_s``)
    and ``overlapped`` seconds per category of the work beside it."""

    rank: int
    runs: int
    total_s: float
    seconds: dict[str, float]
    overlapped: dict[str, float] = field(default_factory=dict)
    end: str = "the end of training"  #: what its last segment ended with, in words (an interruption, an error)

    def share(self, category: str) -> float:
        """``category``'s share of the wall clock (0..1)."""
        return self.seconds.get(category, 0.0) / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "shares": {c: self.share(c) for c in self.seconds}}


def _intervals(rows: list[dict], engine: str) -> tuple[list[_Tagged], dict[str, list[_Span]]]:
    """The trainer thread's intervals ``(start, end, category)`` and the overlapped spans by category."""
    critical: list[_Tagged] = []
    overlapped: dict[str, list[_Span]] = {}
    for r in select(rows, Kind.SPAN):
        cat = r["category"]
        if cat == Category.RUN.value:
            continue
        if r.get("overlapped"):
            overlapped.setdefault(cat, []).append((r["start"], r["end"]))
        else:
            critical.append((r["start"], r["end"], cat))
    for r in select(rows, Kind.ITERATION, Source.TIME_BREAKDOWN, engine=engine):
        end, compute, data = r["time"], r["compute_s"], r["data_s"]
        critical.append((end - compute, end, "compute"))
        critical.append((end - compute - data, end - compute, "data_wait"))
    return critical, overlapped


def _windows(frames: list[_Span], critical: list[_Tagged]) -> list[_Span]:
    """Each run's frame, reaching back to the spans recorded since the previous run ended (its set-up)."""
    out, previous_end = [], float("-inf")
    for start, end in sorted(frames):
        before = [s for s, e, _ in critical if s >= previous_end and e <= end]
        out.append((min([start, *before]), end))
        previous_end = end
    return out


def _union(intervals: list[_Span]) -> float:
    total, reach = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def _sweep(intervals: list[_Tagged]) -> dict[str, float]:
    """Seconds per category, each instant inside an ``idle`` window given to the first active one in ``_PRIORITY``."""
    index = {c: i for i, c in enumerate(_PRIORITY)}
    events = sorted((t, d, index[c]) for s, e, c in intervals if e > s and c in index for t, d in ((s, 1), (e, -1)))
    active = [0] * len(_PRIORITY)
    seconds = [0.0] * len(_PRIORITY)
    prev = None
    for t, d, i in events:
        if prev is not None and t > prev and active[-1] > 0:
            seconds[next(k for k, n in enumerate(active) if n > 0)] += t - prev
        active[i] += d
        prev = t
    return {c: seconds[index[c]] for c in SHARES}


def _unfinished_frames(mine: list[dict], framed: set[int]) -> list[_Span]:
    """A frame for each segment that began a run (``segment_started``) but has no ``run`` span: its process
    stopped before the run ended; the frame goes from the segment's start to its last row."""
    started = {
        r.get("segment", 0): r["time"]
        for r in select(mine, Kind.EVENT, Source.RECORD)
        if r.get("what") == "segment_started"
    }
    out = []
    for seg, start in started.items():
        if seg in framed:
            continue
        last = max((r.get("end", r["time"]) for r in mine if r.get("segment", 0) == seg and "time" in r), default=start)
        out.append((start, max(start, last)))
    return out


def _one_rank(rows: list[dict], rank: int) -> WallClock | None:
    mine = [r for r in rows if r.get("rank", 0) == rank]
    runs = [r for r in select(mine, Kind.SPAN) if r["category"] == Category.RUN.value]
    frames = [(r["start"], r["end"]) for r in runs]
    frames += _unfinished_frames(mine, {r.get("segment", 0) for r in runs})
    if not frames:
        return None
    engine = runs[0].get("engine", "train") if runs else "train"
    critical, overlapped = _intervals(mine, engine)
    windows = _windows(frames, critical)
    intervals = critical + [(s, e, "handlers") for s, e in frames] + [(s, e, "idle") for s, e in windows]
    seconds = _sweep(intervals)
    beside = {c: _union(v) for c, v in sorted(overlapped.items())}
    return WallClock(rank, len(frames), sum(seconds.values()), seconds, beside, _end(mine))


def _end(mine: list[dict]) -> str:
    """What one rank's last segment ended with, in words: the end of training, Ctrl-C, an error, or no end row."""
    last = next(iter(segments(mine).values()))[-1]
    if last["ended"] is False:
        return "its last row (no end row: the process was killed, or it is still running)"
    if last["raised"] == "KeyboardInterrupt":
        return "its interruption (Ctrl-C)"
    return f"the error that stopped it ({last['raised']})" if last["raised"] else "the end of training"


def wall_clock(rows: list[dict]) -> dict[int, WallClock]:
    """Each rank's `WallClock` from a run record's rows (rows without a rank: rank 0; ranks without a run: none)."""
    ranks = sorted({int(r.get("rank", 0)) for r in rows if r.get("kind") in (Kind.SPAN.value, Kind.EVENT.value)})
    rows = [r if "rank" in r else {**r, "rank": 0} for r in rows]
    out = {rank: _one_rank(rows, rank) for rank in ranks}
    return {rank: wc for rank, wc in out.items() if wc is not None}


def table_lines(wc: dict, markdown: bool = True) -> list[str]:
    """The "where the wall clock went" table of a `WallClock.to_dict()`, as markdown or plain text lines."""
    runs = f" ({wc['runs']} runs)" if wc["runs"] > 1 else ""
    head = f"rank {wc['rank']}: {wc['total_s']:.1f} s from set-up to {wc.get('end', 'the end of training')}{runs}"
    rows = [(LABELS.get(c, c), s, wc["shares"][c]) for c, s in wc["seconds"].items()]
    hidden = [(LABELS.get(c, c), s) for c, s in wc["overlapped"].items()]
    if not markdown:
        lines = [head] + [f"  {label:<28} {s:8.2f} s {100 * share:5.1f}%" for label, s, share in rows]
        lines += [f"  overlapped with training (not in the shares): {label} {s:.2f} s" for label, s in hidden]
        return lines
    lines = [head, "", "| where | seconds | share |", "|---|---|---|"]
    lines += [f"| {label} | {s:.2f} | {100 * share:.1f}% |" for label, s, share in rows]
    lines.append(f"| **total** | {wc['total_s']:.2f} | 100.0% |")
    if hidden:
        lines += [
            "",
            "Overlapped with training (ran beside it; not in the shares above):",
            "",
            "| where | seconds |",
            "|---|---|",
        ] + [f"| {label} | {s:.2f} |" for label, s in hidden]
    return lines


_KEEP_CACHE = (
    "keep the cache across runs: FastTraining(cache='disk', cache_dir=...) (a trusted disk cache; the next run "
    "skips the fill)"
)
#: per category: the share of the wall clock at or above which it is worth a fix
_WORTH_A_FIX = {"validation": 0.3, "setup": 0.3, "cache_fill": 0.3, "checkpoint": 0.1, "handlers": 0.2, "idle": 0.2}
#: (category, FastTraining lever and setting that applies the fix or None, fix)
_ADVICE: tuple[tuple[str, tuple[Lever, str | None] | None, str], ...] = (
    (
        "validation",
        None,
        "validate less often: ValidationHandler(interval=N) on your trainer (RecipeConfig.val_interval in the recipes)",
    ),
    (
        "validation",
        None,
        "cheaper validation at the same accuracy: a larger SlidingWindowInferer sw_batch_size "
        "(`monai-fast tune` measures the fastest)",
    ),
    ("validation", None, "validate a subset while the target is far"),
    (
        "validation",
        (Lever.PRECISION, None),
        "mixed precision for the evaluator too: FastTraining(precision='auto') (set on the trainer and the evaluator)",
    ),
    ("setup", (Lever.DATA, "disk"), _KEEP_CACHE),
    ("cache_fill", (Lever.DATA, "disk"), _KEEP_CACHE),
    (
        "checkpoint",
        None,
        "checkpoint less often: a larger Preemption(save_every=...) (or your ignite "
        "Checkpoint / MONAI CheckpointSaver's interval)",
    ),
    (
        "handlers",
        None,
        "between iterations: log and compute metrics less often, persistent_workers=True in your "
        "DataLoader (worker start-up at every epoch), or time your own handlers with RecordHandler.span",
    ),
    ("idle", None, "time outside the recorded work: wrap your set-up in RecordHandler.span('setup') to see it"),
)


def wall_clock_advice(
    wc: WallClock, applied: dict[str, dict], run: InEffect | None = None
) -> tuple[list[str], list[tuple[float, str]]]:
    """Evidence lines and ``(share, fix)`` pairs from the wall clock, one fix line per category that takes much
    of it; a fix that ``FastTraining`` already applied (``applied``: `applied_levers()`), or that does not fit the
    ``run`` (`in_effect()`), is left out."""
    top = sorted(wc.seconds, key=lambda c: -wc.seconds[c])[:3]
    evidence = [
        f"wall clock {wc.total_s:.1f} s (rank {wc.rank}): "
        + ", ".join(f"{LABELS[c]} {100 * wc.share(c):.0f}%" for c in top)
    ]
    if wc.overlapped:
        evidence.append(
            "overlapped with training: " + ", ".join(f"{LABELS.get(c, c)} {s:.1f} s" for c, s in wc.overlapped.items())
        )
    texts: dict[str, list[str]] = {}
    for category, lever, text in _ADVICE:
        if wc.share(category) < _WORTH_A_FIX[category] or any(text in t for t in texts.values()):
            continue
        on = applied.get(lever[0]) if lever else None
        if on is not None and on.get("applied") and (lever[1] is None or on.get("setting") == lever[1]):  # type: ignore[index]
            continue
        if run is not None and lever and lever[0] == Lever.PRECISION and run.precision is not None:
            continue
        if run is not None and not run.batches_windows and ("sliding-window" in text or "sw_batch_size" in text):
            continue
        texts.setdefault(category, []).append(text)
    fixes = [
        (wc.share(c), f"{LABELS[c]} is {100 * wc.share(c):.0f}% of the wall clock: " + "; ".join(t))
        for c, t in texts.items()
    ]
    return evidence, fixes
