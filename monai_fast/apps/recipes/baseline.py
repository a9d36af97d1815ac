"""``baseline``: what a plain MONAI user writes first, the reference the other recipes race."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from monai_fast.apps.recipes.common import Recipe, resolve_amp, seed_everything
from monai_fast.apps.recipes.compose import compose
from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.datasets import uncached_data
from monai_fast.apps.recipes.parts import RecipeParts
from monai_fast.apps.recipes.pieces import dice_loss

__all__ = ["DEFAULTS", "baseline_parts", "build_baseline"]

#: what ``None`` in `RecipeConfig` means for this recipe (MONAI's spleen tutorial's values)
DEFAULTS = {"batch_size": 2, "num_samples": 4, "optimizer": "adam"}


def baseline_parts(config: RecipeConfig | None = None, device: str | torch.device = "cpu") -> RecipeParts:
    """``DiceLoss``, ``Adam(1e-4)``, default layout, fp32 (MONAI's ``amp`` only with ``config.precision="fp16"``).

    Examples:
        >>> baseline_parts(RecipeConfig()).loss().__class__.__name__
        'DiceLoss'
    """
    config = (config or RecipeConfig()).with_defaults(**DEFAULTS)
    device = torch.device(device)
    amp = resolve_amp(config, device, default_on_cuda=False)
    return RecipeParts("baseline", config, device, "fp16" if amp else "fp32", "monai", dice_loss)


def build_baseline(
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """`baseline_parts()` over ``Dataset`` + multi-process ``DataLoader`` (every transform every epoch).

    Options left ``None`` in ``config`` take `DEFAULTS`; ``progress`` is unused (nothing is cached).

    Examples:
        >>> recipe = build_baseline(train_files, val_files, RecipeConfig(max_epochs=2))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    parts = baseline_parts(config, device)
    seed_everything(parts.config)
    return compose(parts, uncached_data(parts, train_files, val_files), t0)
