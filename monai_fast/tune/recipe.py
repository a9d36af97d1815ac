"""Tuning for the recipes' network, loss and optimizer, with the result cached on disk."""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from monai.losses import DiceCELoss
from monai.transforms import Compose

from monai_fast.data.planner import plan_cache
from monai_fast.files import cache_root
from monai_fast.recipes.common import build_network, build_optimizer
from monai_fast.recipes.config import RecipeConfig
from monai_fast.recipes.fast import DEFAULTS as FAST_DEFAULTS
from monai_fast.recipes.transforms import deterministic_transforms, random_transforms
from monai_fast.telemetry.precision import choose_precision
from monai_fast.tune.cache import place_cache
from monai_fast.tune.store import TuneStore
from monai_fast.tune.tuner import SearchSpace, Tuner, TuneResult

__all__ = ["default_space", "default_store_path", "tune_recipe"]

logger = logging.getLogger("monai_fast.tune")


def default_store_path() -> Path:
    """``tuning.json`` in monai-fast's cache folder (:func:`monai_fast.files.cache_root`)."""
    return cache_root() / "tuning.json"


def default_space(device: torch.device | str, search_amp: bool = False, amp: bool | None = None, **kwargs) -> SearchSpace:
    """The recipes' search space: ``fast``'s automatic precision, plus fp32 when ``search_amp``.

    ``amp=False`` (the recipe's fp32 switch) searches fp32 only.
    """
    if amp is False:
        return SearchSpace(precisions=["fp32"], **kwargs)
    first = choose_precision("auto", device)
    precisions = [first, "fp32"] if search_amp else [first]
    return SearchSpace(precisions=precisions, **kwargs)


def typical_val_shape(val_files: Sequence[dict], config: RecipeConfig, n: int = 3) -> tuple[int, int, int]:
    """Median spatial size of up to ``n`` validation volumes after the recipes' cached transforms."""
    if not val_files:
        raise ValueError("no validation files to take a volume size from")
    chain = Compose(deterministic_transforms(config))
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
    **timing,
) -> TuneResult:
    """Tune the ``fast`` recipe's UNet, DiceCE loss and optimizer for ``config``; cached by key.

    Args:
        config: the recipe options (network size, patch size, crops per volume, overlap).
        val_shape: spatial size of a typical validation volume after the cached transforms.
        device: where training runs.
        space: what to search; default :func:`default_space`.
        memory_cap_mib: memory a candidate may use (see :class:`~monai_fast.tune.Tuner`).
        store: the cache file (or a :class:`TuneStore`); default :func:`default_store_path`.
        force: tune again even when the cache holds a result.
        progress: a progress bar over trials.
        train_files: the training items; given, the training cache is placed next to the pick
            (:func:`~monai_fast.tune.cache.place_cache`): its size is measured on two items, it
            goes to device memory (GPU on CUDA, RAM on a CPU) when it fits beside the pick's
            peak, else a smaller batch within ``cache_tradeoff`` of the pick's throughput that
            leaves room is taken, else the planner's next place. ``apply`` then sets
            ``cache_budget_mib``.
        cache_tradeoff: largest share of training throughput given up for a cache in device memory.
        **timing: ``warmup``, ``min_iters``, ``min_time_s`` passed to the tuner (default 1, 2,
            0.3 s: one untimed step, then the median of at least two timed ones).

    Example:
        >>> from monai_fast.recipes import RecipeConfig
        >>> from monai_fast.tune import tune_recipe
        >>> result = tune_recipe(RecipeConfig(), val_shape=(160, 160, 96))  # doctest: +SKIP
        >>> config = result.apply(RecipeConfig())  # doctest: +SKIP
    """
    device = torch.device(device)
    config = config.with_defaults(**FAST_DEFAULTS)
    timing = {"warmup": 1, "min_iters": 2, "min_time_s": 0.3, **timing}
    network = build_network(config, torch.device("cpu"))
    loss = DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, batch=True)
    tuner = Tuner(
        network,
        loss,
        lambda params: build_optimizer(config, params),
        patch_size=config.patch_size,
        val_shape=val_shape,
        device=device,
        num_samples=config.num_samples,
        space=space or default_space(device),
        memory_cap_mib=memory_cap_mib,
        overlap=config.sw_overlap,
        **timing,
    )
    if not isinstance(store, TuneStore):
        store = TuneStore(store or default_store_path())
    key = tuner.key()
    chain = sizing = None
    if train_files is not None:
        chain = Compose(deterministic_transforms(config, precompute_indices=True, plain_tensors=True)
                        + random_transforms(config, precomputed_indices=True))
        sizing = plan_cache(chain, list(train_files), device, gpu_budget=0, ram_budget=0)  # sizes only
        key += f"|cache={sizing.n_items}x{sizing.bytes_per_item}B,tradeoff={cache_tradeoff:g}"
    if not force:
        cached = store.get(key)
        if cached is not None:
            logger.info("tuning: using the cached result from %s", store.path)
            return cached
    result = replace(tuner.run(progress=progress), key=key)
    if sizing is not None:
        cuda = device.type == "cuda"

        def plan_for(budget: int) -> str:
            return plan_cache(chain, list(train_files), device, gpu_budget=budget if cuda else None,
                              ram_budget=None if cuda else budget, cache_dir=config.cache_dir).where

        val_peak = next((t["peak_mib"] for t in result.trials if t["phase"] == "val" and t["feasible"]
                         and t["val_device"] == result.val_device and t["value"] == result.sw_batch_size), None)
        choice = place_cache(result.trials, result.batch_size, result.precision, result.budget_mib,
                             sizing.total_bytes, device, val_peak_mib=val_peak or 0.0, plan_for=plan_for,
                             tradeoff=cache_tradeoff)
        chosen = next(t for t in result.trials
                      if t["phase"] == "train" and t["precision"] == result.precision and t["value"] == choice.batch_size)
        result = replace(result, batch_size=choice.batch_size, train_samples_per_s=float(chosen["throughput"]),
                         cache_where=choice.where, cache_budget_mib=choice.budget_mib, cache_reason="; ".join(choice.reasons))
        logger.info("tuning: cache %s; %s", choice.where, result.cache_reason)
    store.put(result)
    return result
