"""Place the training cache next to the tuned batch: the budget minus the batch's measured peak is the cache's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["CacheChoice", "place_cache"]

MIB = 2**20


@dataclass
class CacheChoice:
    """Where the training cache goes, for which batch size, and why.

    Attributes:
        where: ``"gpu"``, ``"ram"``, ``"disk"``, ``"smartcache"`` or ``"none"``.
        batch_size: the training batch it goes with (the pick, or a smaller one traded for a device cache).
        budget_mib: device memory left for the cache next to that batch; the recipes' ``cache_budget_mib``.
        cache_mib: the cache's measured size, safety margin included.
        reasons: how the choice was made, for the tuning table and the run's notes.
    """

    where: str
    batch_size: int
    budget_mib: float
    cache_mib: float
    reasons: list[str] = field(default_factory=list)


def place_cache(
    trials: Sequence[dict],
    pick: int,
    precision: str,
    budget_mib: float,
    cache_bytes: int,
    device: torch.device | str,
    val_peak_mib: float = 0.0,
    plan_for: Callable[[int], str] | None = None,
    tradeoff: float = 0.05,
) -> CacheChoice:
    """Choose the cache's place and the batch size it goes with, from the tuner's measured trials: device memory
    next to the pick, else next to a smaller batch within ``tradeoff`` of its throughput, else the planner's place.

    Args:
        trials: the tuner's trials (``TuneResult.trials``); ``train`` trials of ``precision`` count.
        pick: the throughput pick's batch size.
        precision: the precision the pick was measured in.
        budget_mib: memory a candidate may peak at (``TuneResult.budget_mib``).
        cache_bytes: the cache's size with its safety margin (``CachePlan.total_bytes``).
        device: the training device; device memory is GPU memory on CUDA, RAM on a CPU.
        val_peak_mib: the picked validation setting's peak, which the cache has to live with too.
        plan_for: budget bytes -> the planner's place (default ``"ram"`` on CUDA, ``"smartcache"`` on a CPU).
        tradeoff: largest share of training throughput given up for a cache in device memory.

    Raises:
        ValueError: ``pick`` has no feasible ``train`` trial of ``precision``, or a bad ``tradeoff`` / ``cache_bytes``.

    Examples:
        >>> trials = [{"phase": "train", "precision": "fp32", "value": v, "feasible": True, "throughput": t,
        ...            "peak_mib": p} for v, t, p in ((2, 96.0, 3000.0), (4, 100.0, 6000.0))]
        >>> choice = place_cache(trials, pick=4, precision="fp32", budget_mib=8000.0, cache_bytes=4000 * 2**20,
        ...                      device="cuda", val_peak_mib=2000.0)
        >>> choice.where, choice.batch_size, choice.budget_mib
        ('gpu', 2, 5000.0)
    """
    if not 0.0 <= tradeoff < 1.0:
        raise ValueError(f"tradeoff must be in [0, 1), got {tradeoff}")
    if cache_bytes < 0:
        raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
    device = torch.device(device)
    home = "gpu" if device.type == "cuda" else "ram"
    train = {
        t["value"]: t
        for t in trials
        if t["phase"] == "train" and t["precision"] == precision and t["feasible"] and t["peak_mib"] is not None
    }
    if pick not in train:
        raise ValueError(f"batch size {pick} has no feasible {precision} training trial to take its peak memory from")
    need_mib = cache_bytes / MIB

    def left(batch: int) -> float:
        return max(0.0, budget_mib - max(train[batch]["peak_mib"], val_peak_mib))

    best = train[pick]["throughput"]
    reasons = [f"cache of {need_mib:.0f} MiB (measured on a few items, margin included)"]
    if need_mib <= left(pick):
        reasons.append(
            f"fits in {'GPU' if home == 'gpu' else 'RAM'} next to batch {pick}: "
            f"{left(pick):.0f} MiB left of the {budget_mib:.0f} MiB budget"
        )
        return CacheChoice(home, pick, left(pick), need_mib, reasons)
    reasons.append(f"does not fit next to batch {pick} ({left(pick):.0f} MiB left)")
    for b in sorted((b for b in train if b < pick), key=lambda b: -train[b]["throughput"]):
        share = train[b]["throughput"] / best
        if share < 1.0 - tradeoff:
            break
        if need_mib <= left(b):
            reasons.append(
                f"batch {b} instead: {100 * (1 - share):.1f} % less training throughput, and the cache "
                f"fits next to it ({left(b):.0f} MiB left), so no host-to-device copies or CPU transforms"
            )
            return CacheChoice(home, b, left(b), need_mib, reasons)
    fallback = plan_for(int(left(pick) * MIB)) if plan_for is not None else ("ram" if home == "gpu" else "smartcache")
    reasons.append(
        f"no batch within {100 * tradeoff:.0f} % of the pick's throughput leaves room for it: "
        f"the planner puts it in {fallback}"
    )
    return CacheChoice(fallback, pick, left(pick), need_mib, reasons)
