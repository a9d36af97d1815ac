"""The spleen (CT, one organ) transform chain of MONAI's spleen tutorials, split where caching can stop.

Everything before the first random transform is deterministic and may be cached; the recipes decide where.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import monai.transforms
import torch
from monai.transforms import (
    EnsureTyped,
    FgBgToIndicesd,
    MapTransform,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandRotate90d,
    RandShiftIntensityd,
    ToDeviced,
)

from monai_fast.apps.recipes.config import RecipeConfig

__all__ = ["KEYS", "deterministic_transforms", "random_transforms", "recipe_chain", "transform_of"]

KEYS = ("image", "label")
FG, BG = "label_fg", "label_bg"


def recipe_chain(config: RecipeConfig) -> list[dict[str, Any]]:
    """The recipes' validation chain for ``config`` as a record; `deterministic_transforms()` builds it."""
    keys = list(KEYS)
    return [
        {"_target_": "LoadImaged", "keys": keys},
        {"_target_": "EnsureChannelFirstd", "keys": keys},
        {"_target_": "Orientationd", "keys": keys, "axcodes": "RAS", "labels": [["L", "R"], ["P", "A"], ["I", "S"]]},
        {"_target_": "Spacingd", "keys": keys, "pixdim": list(config.pixdim), "mode": ["bilinear", "nearest"]},
        {
            "_target_": "ScaleIntensityRanged",
            "keys": "image",
            "a_min": config.intensity_window[0],
            "a_max": config.intensity_window[1],
            "b_min": 0.0,
            "b_max": 1.0,
            "clip": True,
        },
        {"_target_": "CropForegroundd", "keys": keys, "source_key": "image", "allow_smaller": True},
        {"_target_": "SpatialPadd", "keys": keys, "spatial_size": list(config.patch_size)},
    ]


def transform_of(entry: Mapping[str, Any], **extra: Any) -> MapTransform:
    """The MONAI dictionary transform of one chain record entry (its lists as tuples), with ``extra`` arguments."""

    def tuples(value: Any) -> Any:
        return tuple(tuples(v) for v in value) if isinstance(value, list) else value

    args = {k: tuples(v) for k, v in entry.items() if k != "_target_"}
    return getattr(monai.transforms, entry["_target_"])(**args, **extra)


def deterministic_transforms(
    config: RecipeConfig,
    *,
    precompute_indices: bool = False,
    plain_tensors: bool = False,
    device: torch.device | None = None,
) -> list[MapTransform]:
    """Load, orient, resample, window, crop to the body and pad to at least one patch.

    Args:
        config: recipe options (spacing, window, patch size).
        precompute_indices: add ``FgBgToIndicesd`` so the random crop need not search the label every epoch.
        plain_tensors: end with ``EnsureTyped(track_meta=False)``: plain tensors, cheaper to copy and transform.
        device: when a CUDA device, end with ``ToDeviced`` so the cache lives in GPU memory.
    """
    chain = [transform_of(entry) for entry in recipe_chain(config)]
    if precompute_indices:
        chain.append(FgBgToIndicesd(keys="label", fg_postfix="_fg", bg_postfix="_bg", image_key="image"))
    if plain_tensors:
        chain.append(EnsureTyped(keys=KEYS, track_meta=False))
    if device is not None and torch.device(device).type == "cuda":
        chain.append(ToDeviced(keys=KEYS, device=device))
    return chain


def random_transforms(config: RecipeConfig, *, precomputed_indices: bool = False) -> list[MapTransform]:
    """Positive/negative crops (``config.num_samples`` per volume) plus light flips, rotations, intensity shift."""
    if config.num_samples is None:
        raise ValueError("random_transforms needs config.num_samples; use config.with_defaults(num_samples=...)")
    return [
        RandCropByPosNegLabeld(
            keys=KEYS,
            label_key="label",
            spatial_size=config.patch_size,
            pos=1,
            neg=1,
            num_samples=config.num_samples,
            image_key=None if precomputed_indices else "image",
            image_threshold=0,
            fg_indices_key=FG if precomputed_indices else None,
            bg_indices_key=BG if precomputed_indices else None,
        ),
        *(RandFlipd(keys=KEYS, spatial_axis=[axis], prob=0.10) for axis in range(3)),
        RandRotate90d(keys=KEYS, prob=0.10, max_k=3),
        RandShiftIntensityd(keys="image", offsets=0.10, prob=0.50),
    ]
