"""Reusable pieces the recipes are composed of: loss, precision, memory format.

The data pieces are in `monai_fast.apps.recipes.datasets`. Each piece works on plain torch
modules and ignite engines, so it applies as well to a trainer the user built.

Examples:
    >>> import torch
    >>> from monai_fast.apps.recipes.pieces import memory_format_for
    >>> memory_format_for(torch.device("cpu"), "fp32")
    torch.channels_last_3d
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from monai.losses import DiceCELoss, DiceLoss

from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.telemetry.precision import choose_precision

__all__ = ["auto_precision", "dice_ce_loss", "dice_loss", "memory_format_for"]


def dice_loss() -> Callable:
    """``DiceLoss`` on softmax outputs against an integer label map (MONAI's spleen tutorial)."""
    return DiceLoss(to_onehot_y=True, softmax=True)


def dice_ce_loss() -> Callable:
    """``DiceCELoss`` with squared prediction and batch Dice (MONAI's fast-training guide)."""
    return DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, batch=True)


def auto_precision(config: RecipeConfig, device: torch.device) -> str:
    """What `choose_precision()` picks for ``config.precision`` on ``device``.

    Examples:
        >>> auto_precision(RecipeConfig(precision="fp32"), torch.device("cpu"))
        'fp32'
    """
    return choose_precision(config.precision, device)


def memory_format_for(device: torch.device, precision: str) -> torch.memory_format:
    """``channels_last_3d`` weights, the layout oneDNN and cuDNN convolutions prefer, except on a CPU in bf16.

    On a CPU running bf16 the default layout was measured faster (see ``benchmarks/README.md``).
    """
    if device.type == "cpu" and precision == "bf16":
        return torch.contiguous_format
    return torch.channels_last_3d
