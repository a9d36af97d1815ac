"""One training script under python, torchrun (DDP), horovodrun and SLURM, on ``ignite.distributed``.

`run()` calls a function on every rank of whatever job the process is in; ``monai-fast launch``
starts local or multi-node jobs through torchrun and supervises them; the sbatch, Kubernetes and
SageMaker writers turn the same options into those schedulers' files.
"""

from monai_fast.apps.launch.launch import free_port, run, setup_rank

__all__ = ["free_port", "run", "setup_rank"]
