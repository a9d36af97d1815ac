"""Job files for cluster schedulers: a SLURM sbatch script and a Kubernetes ``PyTorchJob`` (Kubeflow's operator).

Both start one rank per GPU and are preemption-safe: a requeued job, or a failed or evicted pod, resumes from its
checkpoints (docs/distributed.md).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PyTorchJobSpec", "SbatchSpec", "pytorchjob", "render_pytorchjob", "render_sbatch"]

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


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^\d+(\.\d+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_NAME_MAX = 45  # pod names add "-worker-<i>" and stay DNS labels (63 characters)


@dataclass
class PyTorchJobSpec:
    """What the job needs; every bad field is named in one `ValueError`.

    Args:
        script: the training script (a path inside the image) and its arguments, as ``monai-fast launch`` takes them.
        image: the container image, with monai-fast installed.
        nodes: pods, one per node: one ``Master`` and ``nodes - 1`` ``Worker`` replicas.
        gpus_per_node, procs_per_node: GPUs per pod (one rank each); ranks per pod when ``gpus_per_node`` is 0.
        cpus_per_node, memory: CPU cores per pod; memory per pod, a Kubernetes quantity (``"64Gi"``; ``None``: default).
        job_name, namespace: the PyTorchJob's name (lower-case letters, digits, ``-``); ``None``: kubectl's namespace.
        grace_s: seconds the ranks get to checkpoint after ``SIGTERM`` (``monai-fast launch --grace-s``).
        backoff_limit: pod restarts (failures, evictions) before the job counts as failed.
        volume_claim, mount_path: a ReadWriteMany PersistentVolumeClaim for data, checkpoints and records; its mount.
        port: the rendezvous port on the master (the operator's default is 23456).
    """

    script: Sequence[str]
    image: str
    nodes: int = 2
    gpus_per_node: int = 1
    procs_per_node: int = 1
    cpus_per_node: int = 8
    memory: str | None = None
    job_name: str = "monai-fast"
    namespace: str | None = None
    grace_s: int = 120
    backoff_limit: int = 3
    volume_claim: str | None = None
    mount_path: str = "/workspace/run"
    port: int = 23456

    def __post_init__(self) -> None:
        problems = []
        if not self.script:
            problems.append(
                "the script is empty: give the training script and its arguments, e.g. train.py --checkpoint-dir /ckpt"
            )
        elif re.match(r"^(.*/)?python[\d.]*$", self.script[0]):
            problems.append(
                f"give the script without {self.script[0]!r}: monai-fast launch runs it with python on every rank"
            )
        elif re.match(r"^(.*/)?monai-fast$", self.script[0]):
            problems.append(
                f"give -m monai_fast {' '.join(self.script[1:2])} instead of {self.script[0]!r}: monai-fast launch "
                "runs a script or a module with python on every rank"
            )
        if not self.image or any(c.isspace() for c in self.image):
            problems.append(f"image {self.image!r} is not an image reference like registry/name:tag")
        at_least = dict.fromkeys(("nodes", "procs_per_node", "cpus_per_node"), 1)
        for name, least in {**at_least, "gpus_per_node": 0, "grace_s": 0, "backoff_limit": 0}.items():
            if getattr(self, name) < least:
                problems.append(f"{name} must be >= {least}, got {getattr(self, name)}")
        for name in ("job_name", "namespace", "volume_claim"):
            value = getattr(self, name)
            if value is not None and (not _DNS_LABEL.match(value) or len(value) > _NAME_MAX):
                problems.append(f"{name} {value!r} must be lower-case letters, digits and '-' (at most {_NAME_MAX})")
        if self.memory is not None and not _QUANTITY.match(self.memory):
            problems.append(f"memory {self.memory!r} is not a Kubernetes quantity like 64Gi")
        if not self.mount_path.startswith("/"):
            problems.append(f"mount_path {self.mount_path!r} must be an absolute path")
        if not 1 <= self.port <= 65535:
            problems.append(f"port {self.port} is not a TCP port (1-65535)")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node > 0 else self.procs_per_node


def _pod_template(spec: PyTorchJobSpec) -> dict[str, Any]:
    wanted = {"cpu": spec.cpus_per_node, "memory": spec.memory, "nvidia.com/gpu": spec.gpus_per_node}
    limits = {k: v for k, v in wanted.items() if v}
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]  # DataLoader workers share tensors here
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if spec.volume_claim:
        mounts.append({"name": "run", "mountPath": spec.mount_path})
        volumes.append({"name": "run", "persistentVolumeClaim": {"claimName": spec.volume_claim}})
    launch = (  # monai-fast launch with the rendezvous the operator set up
        f'exec monai-fast launch --nnodes {spec.nodes} --nproc {spec.ranks_per_node} --node-rank "$RANK" '
        f'--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --grace-s {spec.grace_s} '
        + " ".join(shlex.quote(a) for a in spec.script)
    )
    container = {
        "name": "pytorch",  # the operator looks for this name
        "image": spec.image,
        "command": ["/bin/sh", "-c"],
        "args": [launch],
        "ports": [{"name": "pytorchjob-port", "containerPort": spec.port}],
        "resources": {"requests": {k: v for k, v in limits.items() if k != "nvidia.com/gpu"}, "limits": limits},
        "volumeMounts": mounts,
    }
    # Kubernetes waits this long after SIGTERM before SIGKILL: the ranks' grace and some slack
    return {"spec": {"terminationGracePeriodSeconds": spec.grace_s + 30, "containers": [container], "volumes": volumes}}


def pytorchjob(spec: PyTorchJobSpec) -> dict[str, Any]:
    """The ``kubeflow.org/v1`` PyTorchJob for ``spec``, as a dict (what `render_pytorchjob()` writes)."""
    replica = {"restartPolicy": "OnFailure", "template": _pod_template(spec)}
    replicas = {"Master": {"replicas": 1, **replica}}
    if spec.nodes > 1:
        replicas["Worker"] = {"replicas": spec.nodes - 1, **replica}
    metadata: dict[str, Any] = {"name": spec.job_name}
    if spec.namespace:
        metadata["namespace"] = spec.namespace
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": {
            "runPolicy": {"backoffLimit": spec.backoff_limit, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas,
        },
    }


def _yaml(value: Any, indent: int = 0) -> list[str]:
    """Block-style YAML lines of dicts, lists and scalars (PyYAML is not a dependency)."""
    pad = "  " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines += [f"{pad}{k}:", *_yaml(v, indent + 1)]
            else:
                lines.append(f"{pad}{k}: {json.dumps(v)}")  # JSON scalars (and {} / [] / null) are valid YAML
        return lines
    for item in value:
        if isinstance(item, (dict, list)) and item:
            sub = _yaml(item, indent + 1)
            lines += [f"{pad}- {sub[0].lstrip()}", *sub[1:]]
        else:
            lines.append(f"{pad}- {json.dumps(item)}")
    return lines


def render_pytorchjob(spec: PyTorchJobSpec) -> str:
    """The PyTorchJob manifest for ``spec`` as YAML, for ``kubectl apply -f``.

    Example:
        >>> yaml = render_pytorchjob(PyTorchJobSpec(["train.py"], image="me/monai-fast:1", nodes=3, gpus_per_node=8))
    """
    world = spec.nodes * spec.ranks_per_node
    head = [
        f"# {world} ranks: {spec.nodes} node(s) x {spec.ranks_per_node} "
        + ("GPU(s), one rank per GPU (NCCL)" if spec.gpus_per_node else "CPU rank(s) (gloo)"),
        "# written by 'monai-fast k8s'; needs the Kubeflow training operator. Submit: kubectl apply -f FILE",
        "# the training script calls monai_fast.apps.launch.run(...); with monai_fast.handlers.Preemption and its",
        "# checkpoints on the shared volume, an evicted or failed pod restarts and the job resumes from them",
    ]
    return "\n".join([*head, *_yaml(pytorchjob(spec))]) + "\n"
