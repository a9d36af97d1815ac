"""Recipes: complete MONAI trainer + evaluator set-ups built from file lists and a few options.

A recipe is data: a `RecipeSpec` in `REGISTRY`; `recipe_parts()` turns one into its `RecipeParts`
(what the tuner times) and `build_recipe()` composes those with their data into a `Recipe`.
The recipes: docs/recipes.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType

import torch

from monai_fast.apps.recipes.assembly import (
    VAL_METRIC,
    Recipe,
    compose,
    fast_training,
    guide_cached_data,
    seed_everything,
    uncached_data,
)
from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.parts import (
    RecipeParts,
    contiguous,
    dice_ce_loss,
    dice_loss,
    memory_format_for,
    resolve_amp,
)
from monai_fast.distributed.model import rank_share
from monai_fast.telemetry.precision import choose_precision

__all__ = [
    "REGISTRY",
    "RECIPES",
    "VAL_METRIC",
    "Recipe",
    "RecipeConfig",
    "RecipeParts",
    "RecipeSpec",
    "build_recipe",
    "recipe_parts",
]


@dataclass(frozen=True)
class RecipeSpec:
    """One recipe as data: what sets it apart from the others.

    Attributes:
        defaults: what ``None`` in `RecipeConfig` means for this recipe (`RecipeConfig.with_defaults()`).
        loss: builds its training loss.
        fast_training: `fast_training()` is attached to both engines (planned caches, `choose_precision()`);
            without, MONAI's own fp16 ``amp`` (`resolve_amp()`).
        amp_on_cuda: without ``fast_training``, MONAI's ``amp`` is on by default on CUDA.
        cache_form: the chains end in a cache's form (crop indices precomputed, plain tensors).
        guide_cache: cached as MONAI's fast-training guide does (`guide_cached_data()`), else `uncached_data()`.
        channels_last: the weights take `memory_format_for()`'s layout, else PyTorch's default.
    """

    defaults: Mapping[str, object]
    loss: Callable[[], Callable]
    fast_training: bool = False
    amp_on_cuda: bool = False
    cache_form: bool = False
    guide_cache: bool = False
    channels_last: bool = False


#: the recipes by name, in the order they are raced (``docs/recipes.md`` describes each)
REGISTRY: Mapping[str, RecipeSpec] = MappingProxyType(
    {
        # what a plain MONAI user writes first (MONAI's spleen tutorial): the reference the others race
        "baseline": RecipeSpec({"batch_size": 2, "num_samples": 4, "optimizer": "adam"}, dice_loss),
        # MONAI's fast-training guide: everything cached (in GPU memory on CUDA), a thread loader, AMP on CUDA
        "monai_tutorial": RecipeSpec(
            {"batch_size": 2, "num_samples": 4, "optimizer": "novograd"},
            dice_ce_loss,
            amp_on_cuda=True,
            cache_form=True,
            guide_cache=True,
        ),
        # a plain MONAI trainer made fast by FastTraining, with small batches, AdamW and validation on a schedule
        "fast": RecipeSpec(
            {"batch_size": 1, "num_samples": 2, "optimizer": "adamw", "validation": "schedule"},
            dice_ce_loss,
            fast_training=True,
            cache_form=True,
            channels_last=True,
        ),
    }
)
RECIPES = tuple(REGISTRY)


def recipe_parts(name: str, config: RecipeConfig | None = None, device: str | torch.device = "cpu") -> RecipeParts:
    """The parts recipe ``name`` trains with ``config`` on ``device`` (its defaults filled in); an unknown name
    is a ``ValueError``.

    Examples:
        >>> recipe_parts("fast", RecipeConfig(precision="fp32")).config.batch_size
        1
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown recipe {name!r}; choose one of {RECIPES}")
    spec = REGISTRY[name]
    config = (config or RecipeConfig()).with_defaults(**spec.defaults)
    device = torch.device(device)
    if spec.fast_training:
        precision = choose_precision(config.precision, device)
    else:
        precision = "fp16" if resolve_amp(config, device, default_on_cuda=spec.amp_on_cuda) else "fp32"
    layout = partial(memory_format_for, device) if spec.channels_last else contiguous
    by = "toggle" if spec.fast_training else "monai"
    return RecipeParts(name, config, device, precision, by, spec.loss, cache_form=spec.cache_form, memory_format=layout)


def build_recipe(
    name: str,
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """Build recipe ``name`` (one of `RECIPES`): its `recipe_parts()` over its data, composed into engines.

    In a distributed job each rank builds and caches its share of the files (docs/distributed.md). An
    unknown name is a ``ValueError``.

    Examples:
        >>> recipe = build_recipe("baseline", train_files, val_files, RecipeConfig(max_epochs=1))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    train_files, val_files = rank_share(train_files, even=True), rank_share(val_files, even=False)
    t0 = time.perf_counter()
    parts = recipe_parts(name, config, device)
    spec = REGISTRY[name]
    seed_everything(parts.config)
    if spec.guide_cache:
        data = guide_cached_data(parts, train_files, val_files, progress=progress)
    else:
        data = uncached_data(parts, train_files, val_files)
    return compose(parts, data, t0, levers=fast_training(parts, progress) if spec.fast_training else None)
