"""How big a run on synthetic data is by default on a device (``demo`` and ``train``), with no CUDA call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from monai_fast.apps.training.data import SyntheticData

__all__ = ["DemoScale", "demo_scale"]


@dataclass(frozen=True)
class DemoScale:
    """The default data and network of a run on a device (the demo's and train's).

    Attributes:
        device, name: the device type it is for (``"cuda"``, ``"cpu"``); what the default is, in words.
        synthetic: the synthetic set generated when no data is given.
        overrides: `RecipeConfig` fields (patch, network) set for every recipe.
    """

    device: str
    synthetic: SyntheticData
    overrides: dict[str, Any] = field(default_factory=dict)
    name: str = "small"


def demo_scale(device: torch.device) -> DemoScale:
    """The default size on ``device``: spleen-scale with MONAI's tutorial UNet on CUDA, small elsewhere (docs/demo.md).

    Example:
        >>> demo_scale(torch.device("cpu")).overrides
        {}
    """
    if device.type == "cuda":
        return DemoScale(
            "cuda",
            SyntheticData(cases=40, shape=(240, 240, 96)),  # 1.6 x 1.6 x 2.5 mm: ~256 x 256 x 120 at 1.5 x 1.5 x 2
            dict(patch_size=(96, 96, 96), channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2), num_res_units=2),
            "spleen-scale (like Task09 Spleen after resampling), MONAI's tutorial UNet",
        )
    return DemoScale(device.type, SyntheticData(), {}, "small, for a CPU")
