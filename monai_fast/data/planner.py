"""Where to cache: GPU memory, RAM, disk or a rotating SmartCache, measured, within budgets (docs/data.md)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

import ignite.distributed as idist
import numpy as np
import psutil
import torch
from monai.data import CacheDataset, Dataset, partition_dataset
from monai.transforms import Compose, ToDeviced

from monai_fast.data.background import BackgroundCacheDataset
from monai_fast.data.crop_cache import PATCH_CROPS, CropCacheDataset, flat_transforms, index_bytes
from monai_fast.data.items import NamedItemsCompose, item_bytes, threads_joined_on_error
from monai_fast.data.persistent import TrustedPersistentDataset, first_random
from monai_fast.data.smartcache import SafeSmartCacheDataset
from monai_fast.telemetry import cuda_free_bytes

__all__ = [
    "CACHE_CHOICES",
    "CACHE_PLACES",
    "CachePlan",
    "budgets_in_bytes",
    "default_disk_budget",
    "default_ram_budget",
    "force_plan",
    "plan_cache",
    "rank_partition",
]

logger = logging.getLogger(__name__)

#: bytes in a MiB: budgets are given in MiB and compared in bytes
_MIB = 2**20
Where = Literal["gpu", "ram", "disk", "smartcache", "none"]
#: where a training cache can go: GPU memory, RAM, disk, a rotating SmartCache in RAM, or nowhere
CACHE_PLACES: tuple[str, ...] = get_args(Where)
#: what an option may ask for: a place, or ``"auto"`` (`plan_cache()` measures and decides)
CACHE_CHOICES: tuple[str, ...] = ("auto", *CACHE_PLACES)


def budgets_in_bytes(budgets_mib: dict[str, float | None]) -> list[int | None]:
    """Each ``place: MiB`` budget in bytes (``None`` stays ``None``); a negative one raises ``ValueError``."""
    out = []
    for place, mib in budgets_mib.items():
        if mib is not None and not mib >= 0:
            raise ValueError(f"{place}_budget_mib must be >= 0 MiB, got {mib}")
        out.append(None if mib is None else int(mib * _MIB))
    return out


def default_disk_budget(cache_dir: str | os.PathLike) -> int:
    """Bytes a disk cache in ``cache_dir`` (made here) may take by default: 80 % of its file system's free space."""
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    return int(shutil.disk_usage(cache_dir).free * 0.8)


def default_ram_budget(available: int | None = None) -> int:
    """Bytes of RAM one process may cache by default: half of ``available`` (default: the node's now), shared by
    the node's ranks (N ranks planning at once take half the node, not N halves)."""
    available = psutil.virtual_memory().available if available is None else available
    return available // 2 // max(1, idist.get_nproc_per_node())


def rank_partition(data: Sequence, rank: int, world_size: int, seed: int = 0) -> list:
    """This rank's share of ``data`` (even sizes across ranks, as DDP needs), for per-rank caches."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return list(
        partition_dataset(list(data), num_partitions=world_size, shuffle=True, seed=seed, even_divisible=True)[rank]
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class CachePlan:
    """The planner's decision and the numbers behind it."""

    where: Where
    first_random: int
    n_items: int
    bytes_per_item: int
    margin: float
    budgets: dict[str, int | None]
    device: str
    cache_dir: str | None = None
    cache_num: int | None = None
    tensor_keys: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    reads_patches: bool = False

    @property
    def total_bytes(self) -> int:
        return int(self.bytes_per_item * self.n_items * self.margin)

    @property
    def ram_bytes(self) -> int:
        """Bytes of RAM the plan's cache holds (a SmartCache its window; GPU, disk and no cache none)."""
        if self.where == "ram":
            return self.total_bytes
        if self.where == "smartcache":
            return int(self.bytes_per_item * (self.cache_num or 0) * self.margin)
        return 0

    def describe(self) -> str:
        """One paragraph: what was chosen, and why each better option was not."""
        return "\n".join(self.reasons)

    def build(self, data: Sequence, transform: Compose, background: bool = False, **kwargs: Any) -> Dataset:
        """The data set this plan calls for (``kwargs`` go to its class), its chain a `NamedItemsCompose`.

        ``gpu`` / ``ram``: a ``CacheDataset`` (a `BackgroundCacheDataset` with ``background=True``); ``disk``: a
        `CropCacheDataset` or `TrustedPersistentDataset`; ``smartcache``: a `SafeSmartCacheDataset`.
        """
        if self.where in ("gpu", "ram", "smartcache"):
            kwargs.setdefault("progress", False)
        flat = flat_transforms(transform)  # the transforms `first_random` counts (a chain is made anew only if nested)
        as_given = isinstance(transform, NamedItemsCompose) and flat == list(transform.transforms)
        named = transform if as_given else NamedItemsCompose.of(transform, flat)
        cache_cls = BackgroundCacheDataset if background else CacheDataset
        if background and self.where == "smartcache":
            logger.info(
                "background fill: a SmartCache fills its first window of %s items before training", self.cache_num
            )
        with threads_joined_on_error():  # a failing item ends the fill cleanly, named
            if self.where == "gpu":
                t = list(named.transforms)
                t.insert(self.first_random, ToDeviced(keys=self.tensor_keys, device=self.device))
                if background:
                    kwargs["device"] = self.device
                return cache_cls(data, NamedItemsCompose.of(named, t), cache_rate=1.0, copy_cache=False, **kwargs)
            if self.where == "ram":
                return cache_cls(data, named, cache_rate=1.0, **kwargs)
            if self.where == "disk" and self.reads_patches:
                return CropCacheDataset(data, named, cache_dir=self.cache_dir, **kwargs)
            if self.where == "disk":  # MetaTensors kept: the affine and the applied operations (Invertd) read back
                return TrustedPersistentDataset(
                    data, named, cache_dir=self.cache_dir, track_meta=True, weights_only=False, **kwargs
                )
            if self.where == "smartcache":
                return SafeSmartCacheDataset(data, named, cache_num=self.cache_num, **kwargs)
            return Dataset(data, named)


def plan_cache(
    transform: Compose | Sequence,
    data: Sequence[dict],
    device: str | torch.device = "cpu",
    *,
    gpu_budget_mib: float | None = None,
    ram_budget_mib: float | None = None,
    disk_budget_mib: float | None = None,
    cache_dir: str | os.PathLike | None = None,
    sample: int = 2,
    margin: float = 1.2,
) -> CachePlan:
    """Measure the cached size of ``data`` under ``transform`` and choose where to cache it.

    Args:
        transform: the full chain (a ``Compose`` or a list); it is split at the first random transform.
        data: this rank's items.
        device: the training device; GPU caching is considered only for a CUDA device.
        gpu_budget_mib: MiB of GPU memory the cache may use; default half of what is free now.
        ram_budget_mib: MiB of RAM; default `default_ram_budget()`.
        disk_budget_mib: MiB under ``cache_dir``; default 80 % of its free space.
        cache_dir: where a disk cache would go; without it, disk is not an option.
        sample: items run through the deterministic part to measure their size.
        margin: safety factor on the estimate.

    Raises:
        ValueError: on an empty data list, a bad budget or margin, naming it.

    Examples:
        >>> plan = plan_cache(transforms, train_files, device="cuda", cache_dir="/scratch/cache")  # doctest: +SKIP
        >>> train_ds = plan.build(train_files, transforms)  # doctest: +SKIP
    """
    if not data:
        raise ValueError("data is empty: nothing to plan a cache for")
    if margin < 1.0:
        raise ValueError(f"margin must be >= 1, got {margin}")
    gpu_budget, ram_budget, disk_budget = budgets_in_bytes(
        {"gpu": gpu_budget_mib, "ram": ram_budget_mib, "disk": disk_budget_mib}
    )
    transform = transform if isinstance(transform, Compose) else Compose(list(transform))
    flat = flat_transforms(transform)  # a nested Compose is not itself random: its transforms are counted
    device = torch.device(device)
    first = first_random(flat)
    deterministic = NamedItemsCompose.of(transform, flat[:first])
    n = max(1, min(sample, len(data)))
    samples = [deterministic(dict(data[i])) for i in range(n)]
    per_item = int(np.mean([item_bytes(x) for x in samples]))
    # images (channel + spatial dims) go to the GPU; 1-D crop-index arrays stay, as in MONAI's tutorial
    keys = (
        [k for k, v in samples[0].items() if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim >= 3]
        if isinstance(samples[0], dict)
        else []
    )

    if gpu_budget is None and device.type == "cuda":
        free = cuda_free_bytes(device)
        gpu_budget = None if free is None else free // 2
    ram_budget = default_ram_budget() if ram_budget is None else ram_budget
    plan = CachePlan(
        where="none",
        first_random=first,
        n_items=len(data),
        bytes_per_item=per_item,
        margin=margin,
        budgets={"gpu": gpu_budget, "ram": ram_budget, "disk": disk_budget},
        device=str(device),
        cache_dir=None if cache_dir is None else str(cache_dir),
        tensor_keys=keys,
        reads_patches=first < len(flat) and isinstance(flat[first], PATCH_CROPS),
    )
    need = plan.total_bytes
    head = f"{len(data)} items x {_gib(per_item)} = {_gib(per_item * len(data))} (x{margin:g} margin: {_gib(need)})"
    r = plan.reasons
    r.append(f"cached part: the first {first} of {len(flat)} transforms (up to the first random one)")
    if device.type == "cuda" and gpu_budget is not None and need <= gpu_budget:
        plan.where = "gpu"
        r.append(
            f"cache in GPU memory: {head} fits the GPU budget of {_gib(gpu_budget)}; "
            "load with ThreadDataLoader(num_workers=0), random transforms run on the GPU"
        )
        return plan
    if device.type == "cuda":
        r.append(f"not in GPU memory: {head} exceeds the GPU budget of {_gib(gpu_budget or 0)}")
    if need <= ram_budget:
        plan.where = "ram"
        r.append(f"cache in RAM (CacheDataset): {head} fits the RAM budget of {_gib(ram_budget)}")
        return plan
    r.append(f"not in RAM: {head} exceeds the RAM budget of {_gib(ram_budget)}")
    if disk_budget is None and cache_dir is not None:  # the folder is made only when disk is considered
        disk_budget = default_disk_budget(cache_dir)
        plan.budgets["disk"] = disk_budget
    # the crop tier also writes the crop's int64 indices (a label-driven crop's foreground/background or classes)
    index = int(np.mean([index_bytes(flat[first], x) for x in samples])) if plan.reads_patches else 0
    on_disk = need + int(index * len(data) * margin)
    if index:
        head += f", and {_gib(index)} of crop indices per item ({_gib(on_disk)} on disk)"
    if cache_dir is not None and disk_budget is not None and on_disk <= disk_budget:
        plan.where = "disk"
        how = (
            f"CropCacheDataset in {cache_dir}: the {type(flat[first]).__name__} after it reads only its patches"
            if plan.reads_patches
            else f"TrustedPersistentDataset in {cache_dir}: whole items, the first random transform is no crop"
        )
        r.append(f"cache on disk ({how}): {head} fits the disk budget of {_gib(disk_budget)}")
        return plan
    if cache_dir is not None:
        r.append(f"not on disk: {head} exceeds the disk budget of {_gib(disk_budget or 0)} in {cache_dir}")
    fit = int(ram_budget // max(1, per_item * margin))
    if fit >= 2:
        plan.where, plan.cache_num = "smartcache", min(fit, len(data))
        r.append(
            f"SmartCacheDataset holding {plan.cache_num} of {len(data)} items in RAM, rotating each epoch "
            "(drive it with SmartCacheUpdater)"
        )
        return plan
    r.append("no cache: not even two items fit the RAM budget; every epoch runs every transform")
    return plan


def force_plan(plan: CachePlan, where: Where) -> CachePlan:
    """``plan`` with its place forced to ``where`` (the measurements and reasons kept, the override said).

    Raises:
        ValueError: ``"gpu"`` without a CUDA device, ``"disk"`` without a cache folder, or an unknown place.
    """
    if where not in CACHE_PLACES:
        raise ValueError(f"cache must be one of {', '.join(map(repr, CACHE_PLACES))}, got {where!r}")
    if where == "gpu" and torch.device(plan.device).type != "cuda":
        raise ValueError(f"cache='gpu' needs a CUDA device, got {plan.device}")
    if where == "disk" and plan.cache_dir is None:
        raise ValueError("cache='disk' needs a cache folder (cache_dir)")
    forced: dict = {"where": where}
    if where == "smartcache":
        forced["cache_num"] = max(2, min(plan.n_items, plan.cache_num or plan.n_items // 2))
    return replace(plan, **forced, reasons=[*plan.reasons, f"cache forced to {where} by the options"])
