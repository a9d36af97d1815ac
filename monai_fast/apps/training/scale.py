"""How big a run on synthetic data is by default on a device (``demo`` and ``train``): a pure function of the
device, no CUDA call.

On a CPU the run stays small (16 synthetic volumes, a small UNet) so it ends in minutes on two
cores. On a CUDA device that set would be over in seconds and show little, so the run uses a
spleen-scale set (40 volumes sized like Task09 Spleen after resampling to 1.5 x 1.5 x 2 mm,
96^3 patches) and MONAI's tutorial UNet (channels 16-32-64-128-256, 2 residual units).

Examples:
    >>> import torch
    >>> demo_scale(torch.device("cuda")).synthetic.cases
    40
    >>> demo_scale(torch.device("cpu")).overrides
    {}
"""

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
        device: the device type it is for (``"cuda"``, ``"cpu"``).
        synthetic: the synthetic set generated when no data is given.
        overrides: `RecipeConfig` fields (patch, network) set for every recipe.
        name: what the default is, in words.
    """

    device: str
    synthetic: SyntheticData
    overrides: dict[str, Any] = field(default_factory=dict)
    name: str = "small"


_SPLEEN_SCALE = SyntheticData(cases=40, shape=(240, 240, 96))  # 1.6 x 1.6 x 2.5 mm: ~256 x 256 x 120 at 1.5 x 1.5 x 2
_TUTORIAL_UNET = {
    "patch_size": (96, 96, 96),
    "channels": (16, 32, 64, 128, 256),
    "strides": (2, 2, 2, 2),
    "num_res_units": 2,
}


def demo_scale(device: torch.device) -> DemoScale:
    """The default size on ``device``: spleen-scale with MONAI's tutorial UNet on CUDA, small elsewhere.

    Args:
        device: the resolved training device (``torch.device("cuda")``, ``torch.device("cpu")``...).

    Examples:
        >>> demo_scale(torch.device("cuda")).name
        "spleen-scale (like Task09 Spleen after resampling), MONAI's tutorial UNet"
    """
    if device.type == "cuda":
        return DemoScale(
            "cuda",
            _SPLEEN_SCALE,
            dict(_TUTORIAL_UNET),
            "spleen-scale (like Task09 Spleen after resampling), MONAI's tutorial UNet",
        )
    return DemoScale(device.type, SyntheticData(), {}, "small, for a CPU")
