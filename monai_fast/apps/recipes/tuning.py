"""Tuning of a recipe's own parts (`recipe_parts()`), with the result cached on disk."""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Sequence
from dataclasses import replace

import torch

from monai_fast.apps.recipes import RecipeConfig, recipe_parts
from monai_fast.data.planner import plan_cache
from monai_fast.tune.result import TuneResult, place_cache
from monai_fast.tune.space import SearchSpace
from monai_fast.tune.store import TuneStore, default_store_path
from monai_fast.tune.tuner import Tuner

__all__ = ["default_space", "default_store_path", "tune_recipe", "typical_val_shape"]

logger = logging.getLogger("monai_fast.tune")


def default_space(
    device: torch.device | str, search_amp: bool = False, precision: str | None = None, recipe: str = "fast", **kwargs
) -> SearchSpace:
    """The search space of ``recipe``: the precision it trains in (its request), plus fp32 with ``search_amp``."""
    first = recipe_parts(recipe, RecipeConfig(precision=precision or "auto"), device).precision
    precisions = [first, "fp32"] if search_amp else [first]
    return SearchSpace(precisions=precisions, **kwargs)


def typical_val_shape(
    val_files: Sequence[dict], config: RecipeConfig, n: int = 3, recipe: str = "fast"
) -> tuple[int, int, int]:
    """Median spatial size of up to ``n`` validation volumes after ``recipe``'s validation transforms."""
    if not val_files:
        raise ValueError("no validation files to take a volume size from")
    # the validation chain does not depend on the precision: fp32 spares the precision's measurement
    chain = recipe_parts(recipe, replace(config, precision="fp32")).val_transforms()
    shapes = [tuple(chain(dict(item))["image"].shape[1:]) for item in list(val_files)[:n]]
    return tuple(int(statistics.median(s[i] for s in shapes)) for i in range(3))  # type: ignore[return-value]


def tune_recipe(
    config: RecipeConfig,
    val_shape: tuple[int, int, int],
    device: str | torch.device = "cpu",
    space: SearchSpace | None = None,
    memory_cap_mib: float | None = None,
    store: TuneStore | str | os.PathLike | None = None,
    force: bool = False,
    progress: bool = False,
    train_files: Sequence[dict] | None = None,
    cache_tradeoff: float = 0.05,
    recipe: str = "fast",
    **timing,
) -> TuneResult:
    """Tune ``recipe``'s own parts (`recipe_parts()`: network, layout, loss, optimizer, precision); cached.

    Args:
        config, recipe: the recipe options; a registered recipe name (`RECIPES`).
        val_shape: spatial size of a typical validation volume after the cached transforms.
        device, space: where training runs; what to search (default: the recipe's precision, default ranges).
        memory_cap_mib, progress: memory a candidate may use (see `Tuner`); a progress bar over trials.
        store, force: the cache file or `TuneStore` (default `default_store_path()`); tune again even if cached.
        train_files, cache_tradeoff: given, the training cache is placed beside the pick (`place_cache()`),
            giving up at most this share of training throughput for a cache in device memory.
        **timing: ``warmup``, ``min_iters``, ``min_time_s`` passed to the tuner.

    Examples:
        >>> config = tune_recipe(RecipeConfig(), val_shape=(160, 160, 96)).apply(RecipeConfig())  # doctest: +SKIP
    """
    device = torch.device(device)
    parts = recipe_parts(recipe, config, device)
    timing = {"warmup": 1, "min_iters": 2, "min_time_s": 0.3, **timing}
    tuner = Tuner(
        parts.network(torch.device("cpu")),
        parts.loss(),
        parts.optimizer,
        patch_size=parts.config.patch_size,
        val_shape=val_shape,
        device=device,
        num_samples=parts.config.num_samples,
        space=space or SearchSpace(precisions=[parts.precision]),
        memory_cap_mib=memory_cap_mib,
        overlap=parts.config.sw_overlap,
        memory_format=parts.memory_format,
        **timing,
    )
    if not isinstance(store, TuneStore):
        store = TuneStore(store or default_store_path())
    key = tuner.key()
    sizing = None
    if train_files is not None:
        # sizes only: no budget
        sizing = plan_cache(parts.train_transforms(), list(train_files), device, gpu_budget_mib=0, ram_budget_mib=0)
        key += f"|cache={sizing.n_items}x{sizing.bytes_per_item}B,tradeoff={cache_tradeoff:g}"
    if not force and (cached := store.get(key)) is not None:
        logger.info("tuning: using the cached result from %s", store.path)
        return cached
    result = replace(tuner.run(progress=progress), key=key)
    if sizing is not None:
        files, cuda, chain = list(train_files), device.type == "cuda", parts.train_transforms()

        def plan_for(budget: int) -> str:
            """Where `plan_cache()` puts the training cache with ``budget`` bytes of the device's memory."""
            return plan_cache(
                chain,
                files,
                device,
                gpu_budget_mib=budget / 2**20 if cuda else None,
                ram_budget_mib=None if cuda else budget / 2**20,
                cache_dir=parts.config.cache_dir,
            ).where

        val = result.picked("val") or {}
        choice = place_cache(
            result.trials,
            result.batch_size,
            result.precision,
            result.budget_mib,
            sizing.total_bytes,
            device,
            val_peak_mib=val.get("peak_mib") or 0.0,
            plan_for=plan_for,
            tradeoff=cache_tradeoff,
        )
        chosen = result.picked("train", choice.batch_size)
        result = replace(
            result,
            batch_size=choice.batch_size,
            train_samples_per_s=float(chosen["throughput"]),
            cache_where=choice.where,
            cache_budget_mib=choice.budget_mib,
            cache_reason="; ".join(choice.reasons),
        )
        logger.info("tuning: cache %s; %s", choice.where, result.cache_reason)
    store.put(result)
    return result
