"""Shared parts of the inference tests: a tiny recipe UNet config and its checkpoint, two real NIfTI images."""

from __future__ import annotations

from pathlib import Path

import torch

from monai_fast.inference import save_checkpoint
from monai_fast.recipes import RecipeConfig
from monai_fast.recipes.common import build_network

CONFIG = RecipeConfig(patch_size=(16, 16, 16), channels=(4, 8, 16), strides=(2, 2), num_res_units=1, sw_batch_size=2)


def write_model(path: Path, config: RecipeConfig = CONFIG, seed: int = 0) -> Path:
    """A random-init recipe UNet of ``config`` saved in the inference checkpoint format."""
    torch.manual_seed(seed)
    return save_checkpoint(path, build_network(config, torch.device("cpu")), config)


def images(msd_root: Path, n: int = 2) -> list[str]:
    """The first ``n`` images of an MSD folder."""
    return sorted(str(p) for p in (msd_root / "imagesTr").glob("*.nii.gz"))[:n]
