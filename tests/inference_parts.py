"""Shared parts of the inference tests: a tiny recipe UNet config and its checkpoint, real NIfTI images."""

from __future__ import annotations

from pathlib import Path

import torch
from monai.inferers import SlidingWindowInferer

from monai_fast.apps.inference import save_checkpoint
from monai_fast.apps.inference.run import inference_transforms
from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.recipes.parts import build_network

CONFIG = RecipeConfig(patch_size=(16, 16, 16), channels=(4, 8, 16), strides=(2, 2), num_res_units=1, sw_batch_size=2)


def _balance(net: torch.nn.Module, config: RecipeConfig, image: str) -> None:
    """Shift the last layer's class-1 bias so ``net`` labels half of ``image`` foreground: a random UNet labels
    nearly everything one class, where any backend trivially agrees; half and half puts many voxels near a tie."""
    x = inference_transforms(config)({"image": image})["image"].unsqueeze(0)
    with torch.no_grad():
        logits = SlidingWindowInferer(config.patch_size, config.sw_batch_size, config.sw_overlap)(x, net)
        convs = (torch.nn.Conv3d, torch.nn.ConvTranspose3d)
        last = [m for m in net.modules() if isinstance(m, convs) and m.out_channels == 2]
        last[-1].bias[1] -= (logits[:, 1] - logits[:, 0]).median()


def write_model(path: Path, config: RecipeConfig = CONFIG, seed: int = 0, balance_on: str | None = None) -> Path:
    """A random-init recipe UNet of ``config`` in the inference checkpoint format (balanced on an image if given)."""
    torch.manual_seed(seed)
    net = build_network(config, torch.device("cpu")).eval()
    if balance_on is not None:
        _balance(net, config, balance_on)
    return save_checkpoint(path, net, config)


def images(msd_root: Path, n: int = 2) -> list[str]:
    """The first ``n`` images of an MSD folder."""
    return sorted(str(p) for p in (msd_root / "imagesTr").glob("*.nii.gz"))[:n]
