"""One training script under python, torchrun (DDP), horovodrun and SLURM, on ``ignite.distributed``."""

from monai_fast.apps.launch.launch import free_port, run, setup_rank

__all__ = ["free_port", "run", "setup_rank"]
