"""``fast``: monai-fast's own recipe.

It starts from MONAI's fast-training recipe (:mod:`monai_fast.recipes.monai_tutorial`) and is
where the cache planner, GPU transforms, AMP handling and validation savings land as they are
built and measured; until then it trains exactly like ``monai_tutorial``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from monai_fast.recipes.common import Recipe
from monai_fast.recipes.config import RecipeConfig
from monai_fast.recipes.monai_tutorial import build_cached_recipe

__all__ = ["build_fast"]


def build_fast(
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """monai-fast's recipe; today the same set-up as ``monai_tutorial`` under its own name.

    Example:
        >>> recipe = build_fast(train_files, val_files, RecipeConfig(max_epochs=2))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    return build_cached_recipe("fast", train_files, val_files, config, device, progress)
