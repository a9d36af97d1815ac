"""Patch augmentation on whole batches on the training device: MONAI's example chain of cuCIM GPU kernels where
cuCIM, CuPy and CUDA are present, else the same in torch (`TorchBatchAugment`; docs/pathology.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from monai.engines.utils import PrepareBatch, default_prepare_batch

from monai_fast.extras import available
from monai_fast.telemetry import cuda_available

__all__ = ["AugmentingPrepareBatch", "TorchBatchAugment", "batch_augment", "cucim_status", "to_unit_range"]

logger = logging.getLogger(__name__)

#: MONAI's tumour-detection example's colour jitter (brightness as a fraction of 255)
JITTER = {"brightness": 64.0 / 255.0, "contrast": 0.75, "saturation": 0.25, "hue": 0.04}
_LUMA = (0.299, 0.587, 0.114)
_told: set[str] = set()


def to_unit_range(x: torch.Tensor) -> torch.Tensor:
    """``uint8`` intensities ``[0, 255]`` as float32 in ``[-1, 1]``, the network's input range."""
    return x.float().mul_(2.0 / 255.0).sub_(1.0)


class TorchBatchAugment:
    """Colour jitter, a random horizontal flip and a random 90-degree rotation of a ``uint8`` NCHW batch, in torch.

    Each patch draws its own factors; hue is left out (docs/pathology.md). Returns float32 in ``[-1, 1]``.

    Args:
        prob: probability of the flip, and of the rotation.
        jitter: ``brightness``, ``contrast``, ``saturation`` amplitudes; default `JITTER`.
    """

    def __init__(self, prob: float = 0.5, jitter: dict[str, float] | None = None) -> None:
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"prob must be in [0, 1], got {prob}")
        self.prob = prob
        self.jitter = {**JITTER, **(jitter or {})}

    def _factor(self, n: int, name: str, device: torch.device) -> torch.Tensor:
        amp = self.jitter[name]
        return (1.0 + amp * (2.0 * torch.rand(n, 1, 1, 1, device=device) - 1.0)).clamp_(min=0.0)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch.float().div_(255.0)
        n, dev = x.shape[0], x.device
        x = x * self._factor(n, "brightness", dev)
        mean = x.mean(dim=(1, 2, 3), keepdim=True)
        x = (x - mean) * self._factor(n, "contrast", dev) + mean
        gray = sum(w * x[:, c : c + 1] for c, w in enumerate(_LUMA))
        x = ((x - gray) * self._factor(n, "saturation", dev) + gray).clamp_(0.0, 1.0)
        flip = torch.rand(n, device=dev) < self.prob
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        if x.shape[-1] == x.shape[-2]:
            turns = torch.randint(1, 4, (n,), device=dev) * (torch.rand(n, device=dev) < self.prob)
            for k in range(1, 4):
                chosen = turns == k
                x[chosen] = torch.rot90(x[chosen], k, dims=(-2, -1))
        return x.mul_(2.0).sub_(1.0)


def cucim_status(device: torch.device | str) -> str | None:
    """Why cuCIM's GPU transforms cannot run on ``device`` (a missing package or GPU), or None when they can."""
    device = torch.device(device)
    missing = [m for m in ("cucim", "cupy") if not available(m)]
    if missing:
        return f"{' and '.join(missing)} not installed (pip install cucim-cu12 cupy-cuda12x on a CUDA 12 machine)"
    if device.type != "cuda" or not cuda_available():
        return f"cuCIM runs on a CUDA GPU and this run is on {device}"
    return None


def batch_augment(
    device: torch.device | str, prob: float = 0.5, use_cucim: bool | None = None, quiet: bool = False
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The training augmentation of a ``uint8`` NCHW batch already on ``device``; float32 in ``[-1, 1]`` out.

    Args:
        device, prob: where the batch is; probability of the flip and of the rotation.
        use_cucim: ``None``: cuCIM when it can run here (else torch, with one info line saying why);
            ``True``: cuCIM or a ``RuntimeError`` saying why not; ``False``: torch.
        quiet: no log line (the caller says what was chosen, with `cucim_status()`).
    """
    device = torch.device(device)
    why = cucim_status(device)
    if use_cucim and why is not None:
        raise RuntimeError(f"cuCIM GPU transforms asked for, but {why}")
    if use_cucim is not False and why is None:
        level = logging.DEBUG if quiet else logging.INFO
        logger.log(level, "augmentation: cuCIM on %s (colour jitter, flip, rotate-90 as GPU kernels)", device)
        from monai.transforms import CastToType, Compose, CuCIM, RandCuCIM, ToCupy, ToTensor

        return Compose(  # MONAI's tumour-detection GPU chain; a torch tensor out
            [
                ToCupy(),
                RandCuCIM(name="rand_color_jitter", prob=1.0, **JITTER),
                RandCuCIM(name="rand_image_flip", prob=prob, spatial_axis=-1),
                RandCuCIM(name="rand_image_rotate_90", prob=prob, max_k=3, spatial_axis=(-2, -1)),
                CastToType(dtype=np.float32),
                CuCIM(name="scale_intensity_range", a_min=0.0, a_max=255.0, b_min=-1.0, b_max=1.0),
                ToTensor(device=device, track_meta=False),
            ]
        )
    if use_cucim is None and not quiet and why not in _told:
        _told.add(why)
        logger.info("augmentation: torch on %s instead of cuCIM GPU kernels: %s", device, why)
    return TorchBatchAugment(prob)


class AugmentingPrepareBatch(PrepareBatch):
    """MONAI's default batch preparation (image and label to the device), then ``augment`` on the image there.

    Examples:
        >>> prepare = AugmentingPrepareBatch(batch_augment(device))  # doctest: +SKIP
    """

    def __init__(self, augment: Callable[[torch.Tensor], torch.Tensor] = to_unit_range) -> None:
        self.augment = augment

    def __call__(
        self,
        batchdata: dict[str, torch.Tensor],
        device: str | torch.device | None = None,
        non_blocking: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = default_prepare_batch(batchdata, device, non_blocking, **kwargs)
        image = image.as_tensor() if hasattr(image, "as_tensor") else image  # no MetaTensor bookkeeping per op
        return self.augment(image), label
