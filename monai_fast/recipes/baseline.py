"""``baseline``: what a plain MONAI user writes first, the reference the other recipes race."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from monai.data import DataLoader, Dataset
from monai.losses import DiceLoss
from monai.transforms import Compose

from monai_fast.recipes.common import Recipe, assemble, build_network, resolve_amp, seed_everything
from monai_fast.recipes.config import RecipeConfig
from monai_fast.recipes.transforms import deterministic_transforms, random_transforms

__all__ = ["build_baseline"]


def build_baseline(
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
) -> Recipe:
    """``Dataset`` + multi-process ``DataLoader`` (every transform runs every epoch), ``DiceLoss``,
    ``Adam(1e-4)``, fp32.

    Example:
        >>> recipe = build_baseline(train_files, val_files, RecipeConfig(max_epochs=2))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    config = config or RecipeConfig()
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
    lr = config.lr or 1e-4
    return assemble(
        "baseline",
        config,
        device,
        network,
        torch.optim.Adam(network.parameters(), lr=lr),
        DiceLoss(to_onehot_y=True, softmax=True),
        train_loader,
        val_loader,
        amp=resolve_amp(config, device, default_on_cuda=False),
        t_start=t0,
        notes=[f"Dataset + DataLoader({workers} workers): all transforms every epoch", f"DiceLoss, Adam(lr={lr:g})"],
    )
