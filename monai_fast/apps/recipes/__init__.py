"""Recipes: complete MONAI trainer + evaluator set-ups built from file lists and a few options.

A recipe is registered under its name with two functions of one signature each: its parts
(``(config, device) -> RecipeParts``: network, loss, optimizer, transform chains, precision,
memory format; what the tuner times) and its builder (``(train_files, val_files, config,
device, progress) -> Recipe``), which composes those parts with a data piece.

Examples:
    >>> from monai_fast.apps.recipes import RecipeConfig, build_recipe
    >>> recipe = build_recipe("fast", train_files, val_files, RecipeConfig(max_epochs=5))  # doctest: +SKIP
    >>> recipe.trainer.run()  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import torch

from monai_fast.apps.recipes.baseline import baseline_parts, build_baseline
from monai_fast.apps.recipes.common import VAL_METRIC, Recipe
from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.fast import build_fast, fast_parts
from monai_fast.apps.recipes.monai_tutorial import build_monai_tutorial, monai_tutorial_parts
from monai_fast.apps.recipes.parts import RecipeParts
from monai_fast.distributed.model import rank_share

__all__ = [
    "REGISTRY",
    "RECIPES",
    "VAL_METRIC",
    "Recipe",
    "RecipeConfig",
    "RecipeEntry",
    "RecipeParts",
    "build_recipe",
    "recipe_parts",
]


class RecipeEntry(NamedTuple):
    """One registered recipe: its parts and its builder."""

    parts: Callable[[RecipeConfig | None, str | torch.device], RecipeParts]
    build: Callable[[Sequence[dict], Sequence[dict], RecipeConfig | None, str | torch.device, bool], Recipe]


#: the recipes by name, in the order they are raced
REGISTRY: Mapping[str, RecipeEntry] = MappingProxyType(
    {
        "baseline": RecipeEntry(baseline_parts, build_baseline),
        "monai_tutorial": RecipeEntry(monai_tutorial_parts, build_monai_tutorial),
        "fast": RecipeEntry(fast_parts, build_fast),
    }
)
RECIPES = tuple(REGISTRY)


def _entry(name: str) -> RecipeEntry:
    if name not in REGISTRY:
        raise ValueError(f"unknown recipe {name!r}; choose one of {RECIPES}")
    return REGISTRY[name]


def recipe_parts(name: str, config: RecipeConfig | None = None, device: str | torch.device = "cpu") -> RecipeParts:
    """The parts recipe ``name`` trains with ``config`` on ``device`` (its defaults filled in).

    Raises:
        ValueError: for an unknown recipe name.

    Examples:
        >>> recipe_parts("fast", RecipeConfig(precision="fp32")).config.batch_size
        1
    """
    return _entry(name).parts(config, device)


def build_recipe(
    name: str,
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """Build recipe ``name`` (one of `RECIPES`).

    Inside a distributed job (`monai_fast.distributed.run()`) each rank takes its share of
    ``train_files`` (even sizes) and ``val_files`` (no repeats), so each caches only its share;
    the network is wrapped in DDP (Horovod: its optimizer) and validation Dice is gathered over
    all ranks by MONAI's metric.

    Raises:
        ValueError: for an unknown recipe name.

    Examples:
        >>> recipe = build_recipe("baseline", train_files, val_files, RecipeConfig(max_epochs=1))  # doctest: +SKIP
    """
    build = _entry(name).build
    # under DDP/Horovod each rank builds (and caches) only its share of the files
    train_files, val_files = rank_share(train_files, even=True), rank_share(val_files, even=False)
    return build(train_files, val_files, config, device, progress)
