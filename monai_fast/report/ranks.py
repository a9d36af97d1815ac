"""The doctor's evidence across ranks, nodes and segments: the straggler, placement, restarts, ranks stopped early."""

from __future__ import annotations

import itertools
import operator

from monai_fast.telemetry.record import Kind, Source, data_share, select

__all__ = ["node_evidence", "rank_evidence", "rank_times", "segment_evidence", "segments", "stopped_early"]


def rank_times(epochs: list[dict]) -> dict[int, dict]:
    """Per rank: epochs, data-wait and compute seconds, their sum (``busy_s``) and the data share, from epoch rows."""
    ranks: dict[int, dict] = {}
    for r in epochs:
        agg = ranks.setdefault(int(r.get("rank", 0)), {"epochs": 0, "data_s": 0.0, "compute_s": 0.0})
        agg["epochs"] += 1
        agg["data_s"] += r["data_s"]
        agg["compute_s"] += r["compute_s"]
    for agg in ranks.values():
        agg["busy_s"] = agg["data_s"] + agg["compute_s"]
        agg["data_share"] = data_share(agg["data_s"], agg["compute_s"])
    return dict(sorted(ranks.items()))


def rank_evidence(ranks: dict[int, dict], numbers: dict) -> list[str]:
    """The doctor's lines on the ranks' data wait and the straggler (none for one rank); adds the figures to
    ``numbers``."""
    if len(ranks) < 2:
        return []
    slow = max(ranks, key=lambda k: ranks[k]["busy_s"])
    fast = min(ranks, key=lambda k: ranks[k]["busy_s"])
    ratio = ranks[slow]["busy_s"] / ranks[fast]["busy_s"] if ranks[fast]["busy_s"] > 0 else float("inf")
    numbers.update(per_rank=ranks, slowest_rank=slow, fastest_rank=fast, straggler_ratio=ratio)
    shares = ", ".join(f"rank {k} {100 * v['data_share']:.1f}%" for k, v in ranks.items())
    return [
        f"{len(ranks)} ranks; data wait per rank: {shares}",
        f"slowest rank {slow} ({ranks[slow]['busy_s']:.1f} s) vs fastest rank {fast} ({ranks[fast]['busy_s']:.1f} s): "
        f"{ratio:.2f}x" + (" - a straggler holds every other rank back at each all-reduce" if ratio >= 1.2 else ""),
    ]


def node_evidence(rows: list[dict], numbers: dict) -> list[str]:
    """Which node each rank ran on (the record's ``placement`` rows, the latest per rank), for jobs of several ranks."""
    where = {int(r.get("rank", 0)): r for r in select(rows, Kind.EVENT, Source.RECORD) if r.get("what") == "placement"}
    if len(where) < 2:
        return []
    nodes: dict[tuple[int, str], list[int]] = {}
    for rank, r in sorted(where.items()):
        nodes.setdefault((int(r.get("node_rank", 0)), str(r.get("host", "?"))), []).append(rank)
    numbers["nodes"] = [{"node_rank": n, "host": h, "ranks": ranks} for (n, h), ranks in sorted(nodes.items())]
    listed = "; ".join(
        f"node {n} on {h}: rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for (n, h), rs in sorted(nodes.items())
    )
    return [f"{len(where)} ranks on {len(nodes)} node(s) ({where[min(where)].get('launcher', '?')}): {listed}"]


#: a segment before its rows are read: ``None`` where no row has told, no epoch or iteration timed
_NEW_SEGMENT = {**dict.fromkeys(("start", "last", "pid", "host", "ended", "raised")), "epoch": 0, "iteration": 0}


def segments(rows: list[dict]) -> dict[int, list[dict]]:
    """Per rank, its record's segments in order: ``segment``, ``start`` and ``last`` (times of its first and last
    row), ``pid``, ``host``, ``ended`` (``None``: no segment rows), ``raised`` (the exception that stopped it) and
    the last ``epoch`` and ``iteration`` the trainer timed."""
    out: dict[int, dict[int, dict]] = {}
    for r in rows:
        rank, seg = int(r.get("rank", 0)), int(r.get("segment", 0))
        s = out.setdefault(rank, {}).setdefault(seg, {"segment": seg, **_NEW_SEGMENT})
        t = r.get("end", r.get("time"))
        if isinstance(t, (int, float)):
            s["last"] = t if s["last"] is None else max(s["last"], t)
            first = r.get("start", t)
            s["start"] = first if s["start"] is None else min(s["start"], first)
        what = r.get("what") if r.get("kind") == Kind.EVENT.value and r.get("source") == Source.RECORD.value else None
        if what == "segment_started":
            s["pid"], s["host"] = r.get("pid"), r.get("host")
            s["ended"] = bool(s["ended"])
        elif what == "segment_ended":
            s["ended"] = True
            s["raised"] = r.get("raised")
        elif (
            r.get("kind") == Kind.ITERATION.value
            and r.get("source") == Source.TIME_BREAKDOWN.value
            and r.get("engine", "train") == "train"
        ):
            s["epoch"] = max(s["epoch"], int(r.get("epoch", 0)))
            s["iteration"] = max(s["iteration"], int(r.get("iteration", 0)))
    return {rank: [segs[k] for k in sorted(segs)] for rank, segs in sorted(out.items())}


def last_run(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """The rows of the record's last run, and the evidence line on the earlier runs left out (none: ``[]``).

    A segment whose trainer started from iteration 0 in the process that wrote the segment before it (a
    notebook cell run again) begins a new run; a segment of a new process continues the record (a restart).
    """
    per_rank = segments(rows)
    pids = {s["segment"]: s["pid"] for s in per_rank[min(per_rank)]} if per_rank else {}
    starts = sorted(
        {
            int(r.get("segment", 0))
            for r in select(rows, Kind.EVENT, Source.RECORD, engine="train")
            if r.get("what") == "engine" and r.get("start_iteration") == 0
        }
    )
    first = min((int(r.get("segment", 0)) for r in rows), default=0)
    starts = [s for s in starts if s > first and pids.get(s) is not None and pids.get(s) == pids.get(s - 1)]
    if not starts:
        return rows, []
    earlier = [s for s in starts if s < starts[-1]]
    runs = len(earlier) + (0 if first in earlier else 1)
    kept = [r for r in rows if int(r.get("segment", 0)) >= starts[-1]]
    return kept, [
        f"this folder's record holds {runs} earlier run(s) (segments {first}-{starts[-1] - 1}: a trainer started "
        f"again from its first iteration in the same folder, e.g. a notebook cell run again); this diagnosis reads "
        f"only the last run, from segment {starts[-1]} (a folder per run keeps them apart)"
    ]


def _raised(name: str) -> str:
    """How a segment that raised ``name`` ended, in words."""
    return "interrupted (Ctrl-C)" if name == "KeyboardInterrupt" else f"stopped by an error ({name})"


def interrupted(rows: list[dict], numbers: dict) -> list[str]:
    """The doctor's line on a run whose last segment was stopped by Ctrl-C or an error (rank 0's view); adds
    ``raised`` to ``numbers``."""
    per_rank = segments(rows)
    if not per_rank:
        return []
    last = per_rank[min(per_rank)][-1]
    if not last.get("raised"):
        return []
    numbers["raised"] = last["raised"]
    return [
        f"the run was {_raised(last['raised'])} at epoch {last['epoch']}, iteration {last['iteration']}: "
        "the figures cover the training up to there"
    ]


def segment_evidence(rows: list[dict], numbers: dict) -> list[str]:
    """The doctor's line on the record's segments (none for one segment), consecutive ones of a process that ended
    alike told as one part; adds them to ``numbers``."""
    per_rank = segments(rows)
    if not per_rank:
        return []
    rank = min(per_rank)
    segs = per_rank[rank]
    if len(segs) < 2:
        return []
    numbers["segments"] = segs
    restarts = sum(1 for a, b in zip(segs, segs[1:]) if b["pid"] is not None and a["pid"] != b["pid"])
    numbers["restarts"] = restarts
    parts = []
    for _, grouped in itertools.groupby(segs, key=operator.itemgetter("pid", "host", "ended", "raised")):
        group = list(grouped)
        s = group[-1]
        where = f"pid {s['pid']}" if s["pid"] is not None else "process unknown"
        if s["pid"] is not None and segs.index(group[0]) and segs[segs.index(group[0]) - 1]["pid"] != s["pid"]:
            where += ", a restart"
        stopped = "stopped without its end row (killed or crashed, or its file system filled)"
        end = _raised(s["raised"]) if s["raised"] else {True: "ended", False: stopped, None: "end unknown"}[s["ended"]]
        if len(group) == 1:
            parts.append(f"segment {s['segment']} ({where}) to epoch {s['epoch']}, iteration {s['iteration']}, {end}")
        else:
            parts.append(
                f"segments {group[0]['segment']}-{s['segment']} ({where}) each {end}, the last to epoch {s['epoch']}, "
                f"iteration {s['iteration']}"
            )
    span = max(s["last"] or 0.0 for s in segs) - min(s["start"] or 0.0 for s in segs)
    numbers["segments_span_s"] = span
    return [
        f"the record holds {len(segs)} segments (runs of the trainer; {restarts} restart(s) in a new process) "
        f"over {span:.1f} s from the first start to the last row (rank {rank}): " + "; ".join(parts)
    ]


def stopped_early(rows: list[dict], numbers: dict) -> list[str]:
    """The doctor's lines naming every rank whose record stops before the run's end: its last segment has
    no end row, or it timed fewer iterations than another rank. Adds ``stopped_early`` (ranks) to ``numbers``."""
    per_rank = segments(rows)
    if not per_rank:
        return []
    last = {rank: segs[-1] for rank, segs in per_rank.items()}
    reach = {rank: (s["segment"], s["iteration"]) for rank, s in last.items()}
    furthest = max(reach.values())
    lines, early = [], []
    for rank, s in last.items():
        behind = reach[rank] < furthest
        if s["ended"] is not False and not behind:
            continue
        early.append(rank)
        why = []
        if s["ended"] is False:
            why.append(
                "without an end row (the process was killed or crashed, its file system filled, or it is still running)"
            )
        if behind:
            ahead = next(k for k, v in reach.items() if v == furthest)
            why.append(f"while rank {ahead} reached segment {furthest[0]}, iteration {furthest[1]}")
        lines.append(
            f"rank {rank} stopped early: its record ends at segment {s['segment']}, epoch {s['epoch']}, "
            f"iteration {s['iteration']} " + " ".join(why)
        )
    if early:
        numbers["stopped_early"] = early
    return lines


def missing_ranks(rows: list[dict], ranks_with_files: list[int], numbers: dict) -> list[str]:
    """The doctor's lines naming the ranks of the job that left no rows: an empty record file, or, where two or
    more ranks recorded (not rank 0 alone, by design), a rank below the world size with no file. Adds
    ``missing_ranks`` to ``numbers``."""
    with_rows = {int(r.get("rank", 0)) for r in rows}
    world = max((int(r.get("world_size") or 1) for r in rows if r.get("what") == "segment_started"), default=1)
    empty = sorted(set(ranks_with_files) - with_rows)
    absent = sorted(set(range(world)) - with_rows - set(empty)) if len(with_rows) >= 2 else []
    lines = [f"rank {r} of {world} left an empty record: it was killed or failed before its first row" for r in empty]
    lines += [
        f"rank {r} of {world} left no record: it was killed or failed before its first row, "
        f"or its record.rank{r}.jsonl is gone"
        for r in absent
    ]
    if empty or absent:
        numbers["missing_ranks"] = empty + absent
    return lines
