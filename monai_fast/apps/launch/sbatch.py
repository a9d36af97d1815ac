"""Write an sbatch script that runs a monai-fast training script on a SLURM cluster, preemption-safe."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SbatchSpec", "render_sbatch"]

_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


@dataclass
class SbatchSpec:
    """What the job needs.

    Args:
        command: the training command (``["python", "train.py", "--checkpoint-dir", "ckpt"]``); ``srun`` starts it
            once per task: one task per GPU, or ``tasks_per_node`` per node when ``gpus_per_node`` is 0.
        nodes, gpus_per_node, tasks_per_node, cpus_per_task: the allocation (cores per rank load and cache data).
        time: wall-clock limit, SLURM format (``"04:00:00"``, ``"1-12:00:00"``).
        requeue: let SLURM requeue the job (preemption, node failure); the script resumes.
        signal_lead_s: seconds before the time limit at which SLURM sends SIGUSR1 (for `Preemption`); 0: none.
        job_name, partition, account, mem: the usual SLURM options (``None``: cluster default).
    """

    command: Sequence[str]
    nodes: int = 1
    gpus_per_node: int = 1
    tasks_per_node: int = 1
    cpus_per_task: int = 8
    time: str = "04:00:00"
    requeue: bool = True
    signal_lead_s: int = 120
    job_name: str = "monai-fast"
    partition: str | None = None
    account: str | None = None
    mem: str | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("command is empty: give the training command, e.g. python train.py")
        for name in ("nodes", "cpus_per_task", "tasks_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_node < 0 or self.signal_lead_s < 0:
            raise ValueError("gpus_per_node and signal_lead_s must be >= 0")
        if not _TIME.match(self.time):
            raise ValueError(f"time {self.time!r} is not a SLURM time like 04:00:00 or 1-12:00:00")
        if not re.match(r"^[\w.-]+$", self.job_name):
            raise ValueError(f"job_name {self.job_name!r} may hold letters, digits, '.', '_' and '-' only")

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node > 0 else self.tasks_per_node


def render_sbatch(spec: SbatchSpec) -> str:
    """The sbatch script for ``spec``: every task is one rank (docs/distributed.md).

    Examples:
        >>> script = render_sbatch(SbatchSpec(["python", "train.py"], nodes=2, gpus_per_node=4))
    """
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --ntasks-per-node={spec.ranks_per_node}",
    ]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    lines += [
        f"#SBATCH --cpus-per-task={spec.cpus_per_task}",
        f"#SBATCH --time={spec.time}",
        "#SBATCH --output=%x-%j.out",
        "#SBATCH --open-mode=append",
    ]
    if spec.requeue:
        lines.append("#SBATCH --requeue")
    if spec.signal_lead_s:
        lines.append(f"#SBATCH --signal=USR1@{spec.signal_lead_s}")
    for opt, val in (("partition", spec.partition), ("account", spec.account), ("mem", spec.mem)):
        if val:
            lines.append(f"#SBATCH --{opt}={val}")
    world = spec.nodes * spec.ranks_per_node
    lines += [
        "",
        f"# {world} ranks: {spec.nodes} node(s) x {spec.ranks_per_node} "
        + ("GPU(s), one rank per GPU (NCCL)" if spec.gpus_per_node else "CPU rank(s) (gloo)"),
        "# written by 'monai-fast sbatch'; the training script calls monai_fast.apps.launch.run(...)",
        "set -euo pipefail",
        'echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, restart ${SLURM_RESTART_COUNT:-0}"',
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK}",
        "srun --kill-on-bad-exit=1 " + " ".join(shlex.quote(c) for c in spec.command),
        "",
    ]
    return "\n".join(lines)
