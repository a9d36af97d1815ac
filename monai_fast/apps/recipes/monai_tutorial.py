"""``monai_tutorial``: MONAI's own fast-training recipe, as its fast-training guide describes it.

``CacheDataset`` holding everything up to the first random transform (with foreground/background
indices precomputed and plain tensors), ``ThreadDataLoader`` with no worker processes,
``DiceCELoss`` (squared prediction, batch Dice), ``Novograd`` at ten times the baseline's 2e-4,
AMP on CUDA, and on CUDA the cache itself in GPU memory (``ToDeviced`` at the end of the cached
chain) so random crops and augmentation run on the GPU. This is the peer monai-fast must beat.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from monai_fast.apps.recipes.common import Recipe, resolve_amp, seed_everything
from monai_fast.apps.recipes.compose import compose
from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.datasets import guide_cached_data
from monai_fast.apps.recipes.parts import RecipeParts
from monai_fast.apps.recipes.pieces import dice_ce_loss

__all__ = ["DEFAULTS", "build_monai_tutorial", "monai_tutorial_parts"]

#: what ``None`` in `RecipeConfig` means for this recipe
DEFAULTS = {"batch_size": 2, "num_samples": 4, "optimizer": "novograd"}


def monai_tutorial_parts(config: RecipeConfig | None = None, device: str | torch.device = "cpu") -> RecipeParts:
    """``DiceCELoss``, ``Novograd(2e-3)``, default layout, MONAI's fp16 ``amp`` on CUDA, chains in a cache's form.

    Examples:
        >>> monai_tutorial_parts(RecipeConfig()).config.optimizer
        'novograd'
    """
    config = (config or RecipeConfig()).with_defaults(**DEFAULTS)
    device = torch.device(device)
    amp = resolve_amp(config, device, default_on_cuda=True)
    return RecipeParts(
        "monai_tutorial", config, device, "fp16" if amp else "fp32", "monai", dice_ce_loss, cache_form=True
    )


def build_monai_tutorial(
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """MONAI's fast-training recipe (see the module docstring): `monai_tutorial_parts()` over the guide's cache.

    Examples:
        >>> recipe = build_monai_tutorial(train_files, val_files, RecipeConfig(max_epochs=2))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    parts = monai_tutorial_parts(config, device)
    seed_everything(parts.config)
    return compose(parts, guide_cached_data(parts, train_files, val_files, progress=progress), t0)
