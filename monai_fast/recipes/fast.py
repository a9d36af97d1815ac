"""``fast``: monai-fast's own recipe.

It starts from MONAI's fast-training recipe (:mod:`monai_fast.recipes.monai_tutorial`) and is
where the cache planner, GPU transforms, AMP handling and validation savings land as they are
built and measured. Changes so far, each measured in ``benchmarks/``:

* ``channels_last_3d`` weights: on the demo UNet (2-core CPU, 8x64^3) a training step took
  0.57 s instead of 0.67 s and a 4x64^3 inference 0.050 s instead of 0.067 s (interleaved
  medians of 11 runs); cuDNN prefers this layout too, in particular under AMP.
* mixed precision through :class:`~monai_fast.handlers.AMPToggle` (``RecipeConfig.amp``:
  ``None`` = automatic, ``False`` = fp32): bf16 on GPUs that support it, else fp16 with a
  GradScaler; on a CPU bf16 when a quick measurement shows it is faster. On this project's
  2-core Xeon (AMX/AVX512-BF16) a demo training step took 0.34 s in bf16 against 0.82 s in fp32
  and 0.64 s in fp32 + channels_last_3d; bf16 with channels_last_3d took 0.44 s, so on a CPU
  running bf16 the weights stay in the default layout.
* ``SafeThreadDataLoader`` instead of ``ThreadDataLoader``: the same thread and speed, but an
  item whose transforms raise stops training with an error naming its files, where MONAI's
  loader silently ends the epoch early.
* the training cache goes where :func:`~monai_fast.data.planner.plan_cache` measures it fits
  (``RecipeConfig.cache="auto"``): GPU memory on CUDA, else RAM, else a trusted disk cache
  (with ``cache_dir``), else a SmartCache rotation driven by ``SmartCacheUpdater``; the plan's
  reason is in ``recipe.notes``. On the demo it picks RAM on a CPU and GPU memory on CUDA, as
  MONAI's guide does by hand.
* more, smaller steps with AdamW: batches of 1 volume x 2 crops (``monai_tutorial``: 2 x 4) and
  ``AdamW(lr=3e-3)`` instead of ``Novograd(lr=2e-3)``. On the demo data (2-core CPU, seeds 0-2)
  Dice 0.9 came after 4-6 epochs in 10-16 s, against 12-14 epochs in 32-44 s with the
  ``monai_tutorial`` settings; AdamW alone took 7-11 epochs, the small batches alone 8-10.
  Each epoch makes twice the optimizer steps at half the compute. The experiment is
  ``benchmarks/fast_convergence.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from monai_fast.data.loaders import SafeThreadDataLoader
from monai_fast.handlers.amp import choose_precision
from monai_fast.recipes.common import Recipe
from monai_fast.recipes.config import RecipeConfig
from monai_fast.recipes.monai_tutorial import build_cached_recipe

__all__ = ["DEFAULTS", "build_fast"]

#: what ``None`` in :class:`RecipeConfig` means for this recipe
DEFAULTS = {"batch_size": 1, "num_samples": 2, "optimizer": "adamw"}


def build_fast(
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """monai-fast's recipe: ``monai_tutorial`` plus the measured changes listed in the module docstring.

    Example:
        >>> recipe = build_fast(train_files, val_files, RecipeConfig(max_epochs=2))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    config = config or RecipeConfig()
    dev = torch.device(device)
    precision = "fp32" if config.amp is False else choose_precision("auto", dev)
    channels_last = not (dev.type == "cpu" and precision == "bf16")  # measured slower together on CPU
    return build_cached_recipe(
        "fast", train_files, val_files, config, device, progress,
        channels_last=channels_last, loader_cls=SafeThreadDataLoader, precision=precision, planned=True,
        defaults=DEFAULTS,
    )
