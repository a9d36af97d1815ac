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
from dataclasses import replace

import torch
from monai.data import CacheDataset, ThreadDataLoader
from monai.losses import DiceCELoss
from monai.transforms import Compose

from monai_fast.data.planner import plan_cache
from monai_fast.handlers.amp import AMPToggle
from monai_fast.handlers.smartcache import SmartCacheUpdater
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

__all__ = ["DEFAULTS", "build_cached_recipe", "build_monai_tutorial"]

#: what ``None`` in :class:`RecipeConfig` means for this recipe
DEFAULTS = {"batch_size": 2, "num_samples": 4, "optimizer": "novograd"}


def build_cached_recipe(
    name: str,
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None,
    device: str | torch.device,
    progress: bool = True,
    channels_last: bool = False,
    loader_cls: type[ThreadDataLoader] = ThreadDataLoader,
    precision: str | None = None,
    planned: bool = False,
    defaults: dict | None = None,
) -> Recipe:
    """The cached, thread-loaded, DiceCE set-up behind ``monai_tutorial`` and ``fast``.

    With ``channels_last`` the network's weights use the ``channels_last_3d`` memory format, so
    convolutions run in the layout the CPU (oneDNN) and cuDNN kernels prefer; outputs follow it.
    ``loader_cls`` is the thread loader (``fast`` passes one that surfaces errors). With
    ``precision`` (``"bf16"``/``"fp16"``/``"fp32"``), an :class:`~monai_fast.handlers.AMPToggle`
    on trainer and evaluator runs autocast instead of MONAI's CUDA-only ``amp=True``. With
    ``planned`` the training cache goes where :func:`~monai_fast.data.planner.plan_cache` (or
    ``config.cache``) says; otherwise it is MONAI's guide's: GPU memory on CUDA, else RAM.
    ``defaults`` fill the options left ``None`` in ``config`` (default: :data:`DEFAULTS`).
    """
    t0 = time.perf_counter()
    config = (config or RecipeConfig()).with_defaults(**(DEFAULTS if defaults is None else defaults))
    device = torch.device(device)
    seed_everything(config)
    on_gpu = device.type == "cuda"
    plan = None
    if planned:
        train_ds, train_loader, plan = _planned_train_set(train_files, config, device, loader_cls)
        on_gpu = plan.where == "gpu"  # validation follows the training cache onto the GPU, or not
    else:
        cached = deterministic_transforms(
            config, precompute_indices=True, plain_tensors=True, device=device if on_gpu else None
        )
        train_ds = CacheDataset(
            data=list(train_files),
            transform=Compose(cached + random_transforms(config, precomputed_indices=True)),
            cache_rate=1.0,
            num_workers=config.cache_threads,
            copy_cache=False,
            progress=progress,
        )
        train_loader = loader_cls(train_ds, num_workers=0, batch_size=config.batch_size, shuffle=True)
    val_ds = CacheDataset(
        data=list(val_files),
        transform=Compose(deterministic_transforms(config, plain_tensors=True, device=device if on_gpu else None)),
        cache_rate=1.0,
        num_workers=config.cache_threads,
        copy_cache=False,
        progress=progress,
    )
    val_loader = loader_cls(val_ds, num_workers=0, batch_size=1)
    network = build_network(config, device)
    if channels_last:
        network = network.to(memory_format=torch.channels_last_3d)
    opt = build_optimizer(config, network.parameters())
    lr = opt.param_groups[0]["lr"]
    amp = resolve_amp(config, device, default_on_cuda=True) if precision is None else False
    where = f"GPU memory ({device})" if on_gpu else "CPU RAM"
    if plan is not None:
        where = {"gpu": f"GPU memory ({device})", "ram": "CPU RAM", "disk": f"a disk cache in {plan.cache_dir}",
                 "smartcache": f"a SmartCache of {plan.cache_num} items in RAM", "none": "no cache"}[plan.where]
    recipe = assemble(
        name,
        config,
        device,
        network,
        opt,
        DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, batch=True),
        train_loader,
        val_loader,
        amp=amp,
        t_start=t0,
        notes=[
            f"{type(train_ds).__name__} in {where} ({len(train_ds)} train + {len(val_ds)} val items), "
            f"{loader_cls.__name__}({train_loader.num_workers} workers)",
            f"batch {config.batch_size} x {config.num_samples} crops, DiceCELoss, {type(opt).__name__}(lr={lr:g}), "
            + (f"AMP {'on' if amp else 'off'}" if precision is None else f"AMPToggle {precision}")
            + (", channels_last_3d weights" if channels_last else ""),
        ],
    )
    if plan is not None:
        recipe.notes.append(f"cache plan ({config.cache}): {plan.reasons[-1]}")
        if plan.where == "smartcache":
            SmartCacheUpdater(train_ds).attach(recipe.trainer)
    if precision is not None and precision != "fp32":
        AMPToggle(precision).attach(recipe.trainer)
        AMPToggle(precision).attach(recipe.evaluator)
        recipe.amp = True
    recipe.setup_s = time.perf_counter() - t0
    return recipe


def _planned_train_set(train_files: Sequence[dict], config: RecipeConfig, device: torch.device, loader_cls):
    """The training data set and loader where the cache planner (or ``config.cache``) puts them."""
    full = Compose(
        deterministic_transforms(config, precompute_indices=True, plain_tensors=True)
        + random_transforms(config, precomputed_indices=True)
    )
    budget = None if config.cache_budget_mib is None else int(config.cache_budget_mib * 2**20)
    plan = plan_cache(
        full, list(train_files), device,
        gpu_budget=budget if device.type == "cuda" else None,
        ram_budget=budget if device.type != "cuda" else None,
        cache_dir=config.cache_dir,
    )
    if config.cache != "auto":
        if config.cache == "gpu" and device.type != "cuda":
            raise ValueError(f"cache='gpu' needs a CUDA device, got {device}")
        forced = {"where": config.cache}
        if config.cache == "smartcache":
            forced["cache_num"] = max(2, min(len(train_files), plan.cache_num or len(train_files) // 2))
        plan = replace(plan, **forced, reasons=[*plan.reasons, f"cache forced to {config.cache} by the recipe's options"])
    kwargs: dict = {}
    if plan.where in ("gpu", "ram"):
        kwargs["num_workers"] = config.cache_threads
    elif plan.where == "smartcache":
        kwargs.update(num_init_workers=config.cache_threads, num_replace_workers=config.cache_threads)
    ds = plan.build(list(train_files), full, **kwargs)
    # a cache in memory feeds a thread; a disk cache or none needs worker processes to keep up
    workers = 0 if plan.where in ("gpu", "ram", "smartcache") else config.loader_workers
    loader = loader_cls(ds, num_workers=workers, batch_size=config.batch_size, shuffle=True)
    return ds, loader, plan


def build_monai_tutorial(
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    config: RecipeConfig | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Recipe:
    """MONAI's fast-training recipe (see the module docstring).

    Example:
        >>> recipe = build_monai_tutorial(train_files, val_files, RecipeConfig(max_epochs=2))  # doctest: +SKIP
        >>> recipe.trainer.run()  # doctest: +SKIP
    """
    return build_cached_recipe("monai_tutorial", train_files, val_files, config, device, progress)
