"""What one gradient all-reduce costs in the current job."""

from __future__ import annotations

import statistics
import time

import torch
from ignite import distributed as idist

from monai_fast.telemetry import synchronize

__all__ = ["allreduce_seconds"]


def allreduce_seconds(numel: int, repeats: int = 5) -> float:
    """Median seconds of one all-reduce of ``numel`` float32 values, slowest rank; 0 for one process.

    Every rank must call it. The device is synchronised around each call, so on CUDA the time
    is NCCL's work, not the launch of an asynchronous kernel.

    Example:
        >>> from monai_fast.distributed.comm import allreduce_seconds
        >>> allreduce_seconds(1000)  # one process: nothing to reduce
        0.0
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
    return float(idist.all_reduce(torch.tensor(statistics.median(times), dtype=torch.float64), op="MAX").item())
