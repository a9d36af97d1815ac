"""``fast``: a plain MONAI trainer with the recipe's algorithm choices, made fast by `FastTraining`.

The trainer and evaluator are built as a MONAI user builds them (``Dataset`` + ``DataLoader`` with
worker processes, sliding-window evaluator, see `uncached_data()`);
then ``FastTraining(...).attach(trainer, evaluator)`` applies the levers, the same mechanism a
user's own trainer gets:

* data: both loaders adopted over caches where `plan_cache()`
  measures they fit (``RecipeConfig.cache="auto"``: GPU memory on CUDA, else RAM, else a trusted
  disk cache with ``cache_dir``, else a SmartCache rotation), read by a ``SafeThreadDataLoader``
  (an item whose transforms raise stops training with an error naming its files);
* precision: what `choose_precision()` picks
  for ``RecipeConfig.precision`` (``"auto"`` by default, ``"fp32"``: no mixed precision), on trainer
  and evaluator;
* memory format: ``channels_last_3d`` weights, except on a CPU running bf16 (the rule the tuner
  times too, so the tuned batch size is measured in the layout that trains);
* the recipe's algorithm: ``DiceCELoss`` as ``monai_tutorial``; batches of 1 volume x 2 crops and
  ``AdamW(lr=3e-3)``;
* validation on a schedule (``RecipeConfig.validation="schedule"``): a Dice estimate on two
  validation cases after every epoch decides when the full validation runs (only a full one
  declares the target).

The measurements behind each change are in ``benchmarks/README.md``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import torch

from monai_fast.apps.recipes.common import Recipe, seed_everything
from monai_fast.apps.recipes.compose import compose
from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.datasets import uncached_data
from monai_fast.apps.recipes.parts import RecipeParts
from monai_fast.apps.recipes.pieces import auto_precision, dice_ce_loss, memory_format_for
from monai_fast.handlers.fast_training import FastTraining

__all__ = ["DEFAULTS", "build_fast", "fast_parts", "fast_training"]

#: what ``None`` in `RecipeConfig` means for this recipe
DEFAULTS = {"batch_size": 1, "num_samples": 2, "optimizer": "adamw", "validation": "schedule"}


def fast_parts(config: RecipeConfig | None = None, device: str | torch.device = "cpu") -> RecipeParts:
    """``DiceCELoss``, ``AdamW(3e-3)``, the automatic precision and its memory format, chains in a cache's form.

    Examples:
        >>> fast_parts(RecipeConfig(precision="fp32")).channels_last
        True
    """
    config = (config or RecipeConfig()).with_defaults(**DEFAULTS)
    device = torch.device(device)
    return RecipeParts(
        "fast",
        config,
        device,
        auto_precision(config, device),
        "toggle",
        dice_ce_loss,
        cache_form=True,
        memory_format=partial(memory_format_for, device),
    )


def build_fast(
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """monai-fast's recipe: `fast_parts()` in a plain MONAI trainer, then `fast_training()` attached.

    Examples:
        >>> recipe = build_fast(train_files, val_files, RecipeConfig(max_epochs=2))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    parts = fast_parts(config, device)
    seed_everything(parts.config)
    return compose(parts, uncached_data(parts, train_files, val_files), t0, levers=fast_training(parts, progress))


def fast_training(parts: RecipeParts, progress: bool = False) -> FastTraining:
    """The `FastTraining` the ``fast`` recipe attaches: its cache options, precision and layout.

    Examples:
        >>> fast_training(fast_parts(RecipeConfig(precision="fp32"))).precision
        'fp32'
    """
    config = parts.config
    budget = config.cache_budget_mib
    on_cuda = parts.device.type == "cuda"
    return FastTraining(
        cache=config.cache,
        precision=parts.precision,
        memory_format="channels_last_3d" if parts.channels_last else "contiguous",
        gpu_budget_mib=budget if on_cuda else None,
        ram_budget_mib=None if on_cuda else budget,
        cache_dir=config.cache_dir,
        cache_threads=config.cache_threads,
        background_fill=config.background_fill,
        progress=progress,
    )
