"""``baseline``: what a plain MONAI user writes first, the reference the other recipes race."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from monai.data import DataLoader, Dataset
from monai.losses import DiceLoss
from monai.transforms import Compose

from monai_fast.recipes.common import (
    Recipe,
    assemble,
    build_network,
    build_optimizer,
    resolve_amp,
    seed_everything,
)
from monai_fast.recipes.config import RecipeConfig
from monai_fast.recipes.transforms import deterministic_transforms, random_transforms

__all__ = ["DEFAULTS", "build_baseline"]

#: what ``None`` in :class:`RecipeConfig` means for this recipe (MONAI's spleen tutorial's values)
DEFAULTS = {"batch_size": 2, "num_samples": 4, "optimizer": "adam"}


def build_baseline(
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
) -> Recipe:
    """``Dataset`` + multi-process ``DataLoader`` (every transform runs every epoch), ``DiceLoss``,
    ``Adam(1e-4)``, fp32 (options left ``None`` in ``config`` take :data:`DEFAULTS`).

    Example:
        >>> recipe = build_baseline(train_files, val_files, RecipeConfig(max_epochs=2))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    config = (config or RecipeConfig()).with_defaults(**DEFAULTS)
    device = torch.device(device)
    seed_everything(config)
    train_ds = Dataset(
        data=list(train_files), transform=Compose(deterministic_transforms(config) + random_transforms(config))
    )
    val_ds = Dataset(data=list(val_files), transform=Compose(deterministic_transforms(config)))
    workers = config.loader_workers
    pin = device.type == "cuda"
    train_loader = DataLoader(train_ds, batch_size=config.batch_size, shuffle=True, num_workers=workers, pin_memory=pin)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=workers, pin_memory=pin)
    network = build_network(config, device)
    optimizer = build_optimizer(config, network.parameters())
    return assemble(
        "baseline",
        config,
        device,
        network,
        optimizer,
        DiceLoss(to_onehot_y=True, softmax=True),
        train_loader,
        val_loader,
        amp=resolve_amp(config, device, default_on_cuda=False),
        t_start=t0,
        notes=[f"Dataset + DataLoader({workers} workers): all transforms every epoch", f"DiceLoss, {type(optimizer).__name__}(lr={optimizer.param_groups[0]['lr']:g})"],
    )
