"""Run one training function unchanged under python, torchrun, horovodrun, srun/sbatch or a local spawn.

``monai-fast launch``'s torchrun command line and rendezvous messages are in `monai_fast.apps.launch.torchrun`.
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
    """Per-process set-up inside a (possibly one-process) job: the device and the seeds; returns the device.

    On CUDA each process takes its local rank's GPU; CPU ranks on a node split its cores. Seeds are
    ``seed + rank`` so ranks draw different crops; weights still start equal (DDP broadcasts rank 0's).
    """
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
        # A run that ends by raising (``Preemption.exit_if_preempted``'s SystemExit, an error) keeps
        # its frames, and with them the engines and the DDP module, alive in the traceback: clear
        # their locals so that the collection below can free them.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        # Engines, DDP modules and metric gathers form reference cycles that would otherwise live on
        # until interpreter shutdown, holding the process group. Its worker threads then release their
        # last work (and its tensors) after Python has begun to finalise, and the process aborts with
        # "terminate called without an active exception". Collect now, so that finalize() destroys
        # the group and joins its threads while the interpreter is still whole.
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
    first runs `setup_rank()`. The process group gets ``timeout_s``, so a collective waiting for a dead
    rank ends with an error instead of hanging. See docs/distributed.md.

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
    pg: dict[str, Any] = {}
    if backend is not None and backend != "horovod":
        pg["timeout"] = dt.timedelta(seconds=timeout_s)
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
