"""Recipes: complete MONAI trainer + evaluator set-ups built from file lists and a few options.

Example:
    >>> from monai_fast.recipes import RecipeConfig, build_recipe
    >>> recipe = build_recipe("fast", train_files, val_files, RecipeConfig(max_epochs=5))  # doctest: +SKIP
    >>> recipe.trainer.run()  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from monai_fast.distributed.model import rank_share
from monai_fast.recipes.baseline import build_baseline
from monai_fast.recipes.common import VAL_METRIC, Recipe
from monai_fast.recipes.config import RecipeConfig
from monai_fast.recipes.fast import build_fast
from monai_fast.recipes.monai_tutorial import build_monai_tutorial

__all__ = ["RECIPES", "VAL_METRIC", "Recipe", "RecipeConfig", "build_recipe"]

RECIPES = ("baseline", "monai_tutorial", "fast")


def build_recipe(
    name: str,
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """Build recipe ``name`` (one of :data:`RECIPES`).

    Inside a distributed job (:func:`monai_fast.distributed.run`) each rank takes its share of
    ``train_files`` (even sizes) and ``val_files`` (no repeats), so each caches only its share;
    the network is wrapped in DDP (Horovod: its optimizer) and validation Dice is gathered over
    all ranks by MONAI's metric.

    Raises:
        ValueError: for an unknown recipe name.
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {RECIPES}")
    # under DDP/Horovod each rank builds (and caches) only its share of the files
    train_files, val_files = rank_share(train_files, even=True), rank_share(val_files, even=False)
    if name == "baseline":
        return build_baseline(train_files, val_files, config, device)
    if name == "monai_tutorial":
        return build_monai_tutorial(train_files, val_files, config, device, progress)
    if name == "fast":
        return build_fast(train_files, val_files, config, device, progress)
    raise ValueError(f"unknown recipe {name!r}; choose one of {RECIPES}")
