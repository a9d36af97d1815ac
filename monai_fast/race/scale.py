"""How big the demo is on a device: a pure function of the device, no CUDA call.

On a CPU the demo stays small (16 synthetic volumes, a small UNet) so it ends in minutes on two
cores. On a CUDA device that set would be over in seconds and show little, so the demo uses a
spleen-scale set (40 volumes sized like Task09 Spleen after resampling to 1.5 x 1.5 x 2 mm,
96^3 patches) and MONAI's tutorial UNet (channels 16-32-64-128-256, 2 residual units).

Example:
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

from monai_fast.race.options import RaceSpec, SyntheticData, recipe_config

__all__ = ["DemoScale", "demo_scale", "size_line"]


@dataclass(frozen=True)
class DemoScale:
    """The demo's default data and network on a device.

    Attributes:
        device: the device type it is for (``"cuda"``, ``"cpu"``).
        synthetic: the synthetic set generated when no data is given.
        overrides: :class:`~monai_fast.recipes.RecipeConfig` fields (patch, network) set for every recipe.
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
    """The demo's default size on ``device``: spleen-scale with MONAI's tutorial UNet on CUDA, small elsewhere.

    Args:
        device: the resolved training device (``torch.device("cuda")``, ``torch.device("cpu")``...).

    Example:
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


def size_line(spec: RaceSpec, scale: DemoScale) -> str:
    """The one line the demo prints on its size: the data, patch and network it will train, and ``scale``'s default.

    Example:
        >>> print(size_line(RaceSpec(), demo_scale(torch.device("cpu"))))  # doctest: +NORMALIZE_WHITESPACE
        sized for cpu (default: small, for a CPU): 16 synthetic volumes of 128x128x64 voxels, 64x64x64 patches,
        UNet 8-16-32-64 with 1 residual unit(s); --cases, --shape, --patch-size, --channels change it
    """
    config = recipe_config(spec.overrides, spec.seed)
    if spec.data_dir is not None or spec.train_files is not None:
        data = f"data from {spec.data_dir or 'the given file lists'}"
    else:
        data = f"{spec.synthetic.cases} synthetic volumes of {'x'.join(map(str, spec.synthetic.shape))} voxels"
    return (
        f"sized for {scale.device} (default: {scale.name}): {data}, {'x'.join(map(str, config.patch_size))} patches, "
        f"UNet {'-'.join(map(str, config.channels))} with {config.num_res_units} residual unit(s); "
        "--cases, --shape, --patch-size, --channels change it"
    )
