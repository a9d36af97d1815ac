"""How the ranks of a distributed tuning run agree on a trial (no-ops for one process)."""

from __future__ import annotations

import math

import torch
from ignite import distributed as idist

__all__ = ["agree_on_trial", "gather_errors"]


def agree_on_trial(oom: bool, over: bool, error: bool, peak: int, seconds: float) -> dict:
    """Max over ranks of the flags, the peak memory and the step time (a no-op for one process)."""
    if idist.get_world_size() == 1:
        return {"oom": oom, "over": over, "error": error, "peak": peak, "seconds": seconds}
    secs = seconds if math.isfinite(seconds) else 0.0  # NaN on failed ranks
    t = torch.tensor([float(oom), float(over), float(error), float(peak), secs], dtype=torch.float64)
    t = idist.all_reduce(t, op="MAX")
    return {"oom": t[0] > 0, "over": t[1] > 0, "error": t[2] > 0, "peak": int(t[3]), "seconds": float(t[4])}


def gather_errors(error: BaseException | None) -> str:
    """Every rank's error of this trial, one ``rank N: Type: message`` each, joined by ``; ``."""
    mine = "" if error is None else f"rank {idist.get_rank()}: {type(error).__name__}: {error}"
    if idist.get_world_size() == 1:
        return mine
    return "; ".join(m for m in idist.all_gather(mine) if m)
