"""Which launcher started this process, and which backend fits it."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LAUNCHED_BY", "LaunchEnv", "detect", "nested_spawn_message", "pick_backend", "placement"]

LAUNCHED_BY = "MONAI_FAST_LAUNCH"
"""Set (to the number of processes) in the environment of the ranks that ``monai-fast launch`` starts."""


@dataclass(frozen=True)
class LaunchEnv:
    """What the environment says about the job this process belongs to.

    Attributes:
        launcher: ``"torchrun"``, ``"horovod"``, ``"slurm"`` or ``"none"`` (plain ``python``).
        world_size: processes in the job (1 for ``"none"``).
        rank: this process's global rank.
        local_rank: this process's rank on its node.
        node_rank: the node's index in the job; 0 on one node.
        nnodes: nodes in the job; 1 on one node.
    """

    launcher: str
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    nnodes: int = 1


def _int(env: Mapping[str, str], *names: str, default: int = 0) -> int:
    for n in names:
        if n in env:
            try:
                return int(env[n])
            except ValueError:
                raise ValueError(f"environment variable {n}={env[n]!r} is not an integer") from None
    return default


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher from the environment: torchrun's ``TORCHELASTIC_RUN_ID`` first (it may run inside a SLURM
    job), then Horovod, then SLURM with more than one task, then other ``env://`` launchers (``LOCAL_RANK``).

    Example:
        >>> detect({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
        LaunchEnv(launcher='torchrun', world_size=4, rank=3, local_rank=0, node_rank=0, nnodes=1)
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        return _ranks(env, "torchrun")
    if "HOROVOD_RANK" in env or ("OMPI_COMM_WORLD_RANK" in env and any(k.startswith("HOROVOD_") for k in env)):
        return _ranks(env, "horovod")
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", default=1) > 1:  # srun's tasks
        return _ranks(env, "slurm")
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env:  # torch.distributed.launch and other env:// launchers
        return _ranks(env, "torchrun")
    return LaunchEnv("none")


#: per launcher, the variables that hold (world size, rank, local rank, node rank, nodes), first found wins
_VARIABLES: dict[str, tuple[tuple[str, ...], ...]] = {
    "torchrun": (("WORLD_SIZE",), ("RANK",), ("LOCAL_RANK",), ("GROUP_RANK",), ("GROUP_WORLD_SIZE",)),
    "horovod": (
        ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE"),
        ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"),
        ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("HOROVOD_CROSS_RANK",),
        ("HOROVOD_CROSS_SIZE",),
    ),
    "slurm": (
        ("SLURM_NTASKS",),
        ("SLURM_PROCID",),
        ("SLURM_LOCALID",),
        ("SLURM_NODEID",),
        ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
    ),
}


def _ranks(env: Mapping[str, str], launcher: str) -> LaunchEnv:
    """``launcher``'s variables read into a `LaunchEnv`; a count that is not set is 1, a rank 0."""
    size, rank, local, node, nodes = _VARIABLES[launcher]
    return LaunchEnv(
        launcher,
        _int(env, *size, default=1),
        _int(env, *rank),
        _int(env, *local),
        _int(env, *node),
        _int(env, *nodes, default=1),
    )


def placement(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Where this process runs: the host's name and `detect()`'s node and local rank, for the run record.

    Several "nodes" may share one host name (containers), so a node is told apart by ``node_rank``.
    """
    env = detect(environ)
    return {
        "host": socket.gethostname(),
        "launcher": env.launcher,
        "node_rank": env.node_rank,
        "nnodes": env.nnodes,
        "local_rank": env.local_rank,
    }


def pick_backend(env: LaunchEnv, cuda: bool, nproc_per_node: int | None = None) -> str | None:
    """``"horovod"`` under horovodrun, else ``"nccl"`` with CUDA or ``"gloo"`` without; ``None`` for one process."""
    if env.launcher == "horovod":
        return "horovod"
    if env.launcher == "none" and not (nproc_per_node and nproc_per_node > 1):
        return None
    return "nccl" if cuda else "gloo"


def nested_spawn_message(nproc_per_node: int, env: LaunchEnv, environ: Mapping[str, str] | None = None) -> str:
    """Why a rank must not start ``nproc_per_node`` processes of its own, and what to change."""
    environ = os.environ if environ is None else environ
    by = f"monai-fast launch (torchrun, --nproc {environ[LAUNCHED_BY]})" if LAUNCHED_BY in environ else env.launcher
    return (
        f"nproc_per_node={nproc_per_node} was given, but this process was already started by {by} as rank {env.rank} "
        f"of {env.world_size}: starting {nproc_per_node} more processes per rank makes separate jobs that fight over "
        "one rendezvous port. Drop nproc_per_node (keep backend: idist.Parallel(backend=...) or "
        "monai_fast.apps.launch.run(train)) so each rank joins the launched job, or start the script with plain python"
    )
