"""The doctor's evidence across ranks and nodes: per-rank time split, the straggler, which node each rank ran on.

Read from the run record's rows (all ranks' files merged by :func:`monai_fast.telemetry.record.load_record`);
:func:`monai_fast.report.doctor.diagnose` adds these lines to its evidence for jobs of several ranks.

Example:
    >>> ranks = rank_times([{"rank": 0, "data_s": 1.0, "compute_s": 9.0}, {"rank": 1, "data_s": 1.0, "compute_s": 14.0}])
    >>> rank_evidence(ranks, numbers := {})[1]
    'slowest rank 1 (15.0 s) vs fastest rank 0 (10.0 s): 1.50x - a straggler holds every other rank back at each all-reduce'
"""

from __future__ import annotations

from monai_fast.telemetry.record import Kind, Source, data_share, select

__all__ = ["node_evidence", "rank_evidence", "rank_times"]


def rank_times(epochs: list[dict]) -> dict[int, dict]:
    """Per rank: epochs, data-wait and compute seconds, their sum (``busy_s``) and the data share, from epoch rows.

    Example:
        >>> rank_times([{"rank": 1, "data_s": 1.0, "compute_s": 3.0}])[1]["data_share"]
        0.25
    """
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
    """The doctor's lines on the ranks' data wait and the straggler (none for one rank); adds the figures to ``numbers``."""
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
    listed = "; ".join(f"node {n} on {h}: rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                       for (n, h), rs in sorted(nodes.items()))
    return [f"{len(where)} ranks on {len(nodes)} node(s) ({where[min(where)].get('launcher', '?')}): {listed}"]
