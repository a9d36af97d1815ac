"""One training script under python, torchrun (DDP), horovodrun and SLURM, on ``ignite.distributed``."""

from monai_fast.distributed.comm import allreduce_seconds
from monai_fast.distributed.env import LaunchEnv, detect, pick_backend
from monai_fast.distributed.launch import free_port, run, setup_rank

__all__ = ["LaunchEnv", "allreduce_seconds", "detect", "free_port", "pick_backend", "run", "setup_rank"]
