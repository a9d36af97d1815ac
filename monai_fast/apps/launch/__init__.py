"""Run one training function unchanged under python, torchrun (DDP), horovodrun, srun/sbatch or a local spawn.

The modules write the launchers' command lines and job files: torchrun, SLURM sbatch, Kubernetes, SageMaker.
"""

from __future__ import annotations

import datetime as dt
import gc
import logging
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
from ignite import distributed as idist
from monai.utils import set_determinism

from monai_fast.distributed.env import detect, nested_spawn_message, pick_backend
from monai_fast.telemetry import cuda_available, set_cuda_device

__all__ = ["free_port", "run", "setup_rank"]

logger = logging.getLogger("monai_fast.distributed")


def free_port() -> int:
    """A local TCP port that was free a moment ago (for a rendezvous on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def setup_rank(seed: int | None = 0) -> torch.device:
    """Per-process set-up: the local rank's GPU (or a share of the node's cores), seeds ``seed + rank``; the device."""
    device = idist.device()
    if device.type == "cuda":
        device = set_cuda_device(device)  # one process: ignite names no index, and the current device is kept
    elif idist.get_nproc_per_node() > 1 and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks on one node share its cores (torchrun sets OMP_NUM_THREADS=1 itself)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // idist.get_nproc_per_node()))
    if seed is not None:
        set_determinism(seed=seed + idist.get_rank())
    return device


def _entry(local_rank: int, fn: Callable, seed: int | None, args: tuple, kwargs: dict) -> None:
    setup_rank(seed)
    try:
        fn(local_rank, *args, **kwargs)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # its frames would keep the engines and DDP module alive
        raise
    finally:
        # engines, DDP modules and metric gathers form reference cycles holding the process group: freed now,
        # finalize() joins its threads before interpreter shutdown ("terminate called without an active exception")
        gc.collect()


def run(
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = "auto",
    nproc_per_node: int | None = None,
    seed: int | None = 0,
    timeout_s: float = 300.0,
    **kwargs: Any,
) -> None:
    """Call ``fn(local_rank, *args, **kwargs)`` on every rank of whatever job this process is in.

    One process, N local processes (``nproc_per_node``), or the ranks torchrun, ``srun`` or horovodrun
    made. ``backend="auto"`` picks Horovod under horovodrun, NCCL with CUDA, gloo without; each rank
    first runs `setup_rank()`; a collective waiting ``timeout_s`` for a dead rank fails (docs/distributed.md).

    Examples:
        >>> if __name__ == "__main__":  # doctest: +SKIP
        ...     run(train, {"lr": 1e-3})
    """
    env = detect()
    if nproc_per_node is not None and env.launcher != "none":
        raise ValueError(nested_spawn_message(nproc_per_node, env))
    if backend == "auto":
        backend = pick_backend(env, cuda_available(), nproc_per_node)
    elif backend is None and env.world_size > 1:
        raise ValueError(f"backend=None, but {env.launcher} started {env.world_size} processes; use backend='auto'")
    if nproc_per_node is not None and nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    pg = {"timeout": dt.timedelta(seconds=timeout_s)} if backend not in (None, "horovod") else {}
    if backend is not None and nproc_per_node is not None and nproc_per_node > 1:
        logger.info("spawning %d local processes, backend %s", nproc_per_node, backend)
        with idist.Parallel(
            backend=backend, nproc_per_node=nproc_per_node, master_port=free_port(), start_method="spawn", **pg
        ) as parallel:
            parallel.run(_entry, fn, seed, args, kwargs)
        return
    if backend is not None:
        idist.initialize(backend, **pg)
    logger.info(
        "launcher %s, backend %s, rank %d of %d", env.launcher, backend, idist.get_rank(), idist.get_world_size()
    )
    try:
        _entry(idist.get_local_rank(), fn, seed, args, kwargs)
    finally:
        if backend is not None:
            idist.finalize()
