"""``fast``: monai-fast's own recipe, MONAI's fast-training recipe plus measured changes.

Composed of the shared pieces:

* data: the training cache where :func:`~monai_fast.data.planner.plan_cache` measures it fits
  (``RecipeConfig.cache="auto"``: GPU memory on CUDA, else RAM, else a trusted disk cache with
  ``cache_dir``, else a SmartCache rotation driven by ``SmartCacheUpdater``), validation cached
  beside it, both read by a ``SafeThreadDataLoader`` (an item whose transforms raise stops
  training with an error naming its files);
* precision: an :class:`~monai_fast.handlers.AMPToggle` on trainer and evaluator at the precision
  :func:`~monai_fast.telemetry.precision.choose_precision` picks (``RecipeConfig.amp=False``: fp32);
* memory format: ``channels_last_3d`` weights, except on a CPU running bf16;
* loss and optimizer: ``DiceCELoss`` as ``monai_tutorial``; batches of 1 volume x 2 crops and
  ``AdamW(lr=3e-3)``.

The measurements behind each change are in ``benchmarks/README.md``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import torch

from monai_fast.data.loaders import SafeThreadDataLoader
from monai_fast.recipes.common import Recipe, seed_everything
from monai_fast.recipes.compose import compose
from monai_fast.recipes.config import RecipeConfig
from monai_fast.recipes.datasets import planned_cached_data
from monai_fast.recipes.parts import RecipeParts
from monai_fast.recipes.pieces import auto_precision, dice_ce_loss, memory_format_for

__all__ = ["DEFAULTS", "build_fast", "fast_parts"]

#: what ``None`` in :class:`RecipeConfig` means for this recipe
DEFAULTS = {"batch_size": 1, "num_samples": 2, "optimizer": "adamw"}


def fast_parts(config: RecipeConfig | None = None, device: str | torch.device = "cpu") -> RecipeParts:
    """``DiceCELoss``, ``AdamW(3e-3)``, the automatic precision and its memory format, chains in a cache's form.

    Example:
        >>> fast_parts(RecipeConfig(amp=False)).channels_last
        True
    """
    config = (config or RecipeConfig()).with_defaults(**DEFAULTS)
    device = torch.device(device)
    return RecipeParts(
        "fast", config, device, auto_precision(config, device), "toggle", dice_ce_loss,
        cache_form=True, memory_format=partial(memory_format_for, device),
    )


def build_fast(
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """monai-fast's recipe: :func:`fast_parts` over the planned cache and a ``SafeThreadDataLoader``.

    Example:
        >>> recipe = build_fast(train_files, val_files, RecipeConfig(max_epochs=2))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    parts = fast_parts(config, device)
    seed_everything(parts.config)
    return compose(parts, planned_cached_data(parts, train_files, val_files, SafeThreadDataLoader, progress), t0)
