"""Where a rank runs and what it shares: the launcher detected, the backend picked, seconds averaged over ranks.

The plugin's part of the distributed layer (the record, the tuner and the handlers use it); starting
ranks is the application's (`monai_fast.apps.launch`).
"""

from monai_fast.distributed.comm import allreduce_seconds
from monai_fast.distributed.env import LaunchEnv, detect, pick_backend

__all__ = ["LaunchEnv", "allreduce_seconds", "detect", "pick_backend"]
