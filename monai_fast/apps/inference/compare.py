"""How far two predictions of the same volume agree: mean foreground Dice and the share of equal voxels."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["MIN_DICE", "agreement"]

#: the mean Dice between a backend's predictions and eager fp32's that counts as agreeing
MIN_DICE = 0.99


def agreement(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor, num_classes: int = 2) -> dict[str, float]:
    """Mean Dice over the classes ``1..num_classes-1`` between label maps ``a`` and ``b``; the share of equal voxels.

    A class absent from both counts as Dice 1; maps of different shapes raise ``ValueError``.
    """
    a, b = (x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x) for x in (a, b))
    if a.shape != b.shape:
        raise ValueError(f"predictions of different shapes cannot be compared: {a.shape} and {b.shape}")
    dice = []
    for c in range(1, num_classes):
        in_a, in_b = a == c, b == c
        total = int(in_a.sum()) + int(in_b.sum())
        dice.append(1.0 if total == 0 else 2.0 * int(np.logical_and(in_a, in_b).sum()) / total)
    return {"dice": float(np.mean(dice)), "voxels": float((a == b).mean()) if a.size else 1.0}
