"""What one gradient all-reduce costs in the current job."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from ignite import distributed as idist

from monai_fast.telemetry import synchronize

__all__ = ["allreduce_seconds"]


def allreduce_seconds(
    numel: int, repeats: int = 5, statistic: Callable[[Sequence[float]], float] = statistics.median
) -> float:
    """Seconds of one all-reduce of ``numel`` float32 values (``statistic`` of ``repeats``, slowest rank); 0 for
    one process. Every rank must call it.

    The device is synchronised around each call, so on CUDA the time is NCCL's work. The median (default) is what
    a training step pays; ``min`` is the link's floor, what a latency/bandwidth fit wants on a busy host.
    """
    if idist.get_world_size() == 1:
        return 0.0
    device = idist.device()
    buf = torch.zeros(numel, device=device)
    idist.all_reduce(buf)  # warm-up (connections, buffers)
    times = []
    for _ in range(max(1, repeats)):
        idist.barrier()
        synchronize(device)
        t = time.perf_counter()
        idist.all_reduce(buf)
        synchronize(device)
        times.append(time.perf_counter() - t)
    return float(idist.all_reduce(torch.tensor(statistic(times), dtype=torch.float64), op="MAX").item())
