"""Adopt a user's ``DataLoader``: the same batches from a planned cache and a safe thread loader.

What cannot be adopted is a reason, never half-done; the rules are in docs/data.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from monai.data import (
    CacheDataset,
    Dataset,
    PersistentDataset,
    SmartCacheDataset,
    ThreadDataLoader,
    list_data_collate,
    pad_list_data_collate,
)
from monai.transforms import Compose
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from monai_fast.data.background import BackgroundCacheDataset, fill_order_options
from monai_fast.data.crop_cache import PATCH_CROPS, CropCacheDataset
from monai_fast.data.loaders import WORKER_OPTIONS, SafeThreadDataLoader
from monai_fast.data.persistent import first_random
from monai_fast.data.planner import (
    CACHE_CHOICES,
    CachePlan,
    budgets_in_bytes,
    default_disk_budget,
    default_ram_budget,
    force_plan,
    plan_cache,
    rank_partition,
)
from monai_fast.data.rng_state import randomizables
from monai_fast.data.smartcache import SafeSmartCacheDataset, window_bytes
from monai_fast.progress import show_progress

__all__ = ["AdoptedData", "THREAD_SAFE_COLLATES", "adopt_loader", "unknown_item_path", "why_not_adoptable"]

logger = logging.getLogger("monai_fast.data")

#: collate functions known to hold no state between calls, so a background thread may run them
THREAD_SAFE_COLLATES: tuple[Callable, ...] = (default_collate, list_data_collate, pad_list_data_collate)
_CACHES = (CacheDataset, PersistentDataset, SmartCacheDataset)
#: MONAI's classes whose item is ``transform(data[index])`` (cached or not, a SmartCache's over its window)
KNOWN_ITEM_PATHS: tuple[type, ...] = (Dataset, *_CACHES)
_ITEM_PATH = ("__getitem__", "__getitems__", "_transform", "__len__")
_ROTATION = (
    "set_data",
    "randomize",
    "is_started",
    "start",
    "update_cache",
    "shutdown",
    "manage_replacement",
    "_load_cache_item",
    "_fill_cache",
    "_restart",
    "_try_update_cache",
    "_try_shutdown",
    "_compute_data_idx",
    "_replace_cache_thread",
    "_compute_replacements",
    "_try_manage_replacement",
)


def _chain(transform: Any) -> Compose:
    return transform if isinstance(transform, Compose) else Compose([transform])


def unknown_item_path(dataset: Any, rotation: bool = False) -> str | None:
    """Why ``dataset``'s items cannot be rebuilt from its ``.data`` and ``.transform``, or ``None`` when they can.

    The methods making an item (with ``rotation``, a SmartCache's rotation too) must be MONAI's or monai-fast's.
    """
    own = []
    for name in _ITEM_PATH + (_ROTATION if rotation else ()):
        owner = next((c for c in type(dataset).__mro__ if name in vars(c)), None)
        if owner is None or owner in KNOWN_ITEM_PATHS or owner.__module__.split(".")[0] in ("monai_fast", "builtins"):
            continue
        if owner.__module__.startswith("monai.") and owner in SmartCacheDataset.__mro__:  # Randomizable's own
            continue
        own.append(f"{owner.__name__}.{name}")
    if not own:
        return None
    names = ", ".join(sorted({o.rsplit(".", 1)[1] for o in own}))
    what = "its items or their rotation" if rotation else "its items"
    return (
        f"the data set's class {type(dataset).__name__} has its own {names} ({', '.join(own)}): {what} may "
        "differ from MONAI's transform(data[i]), so it is not rebuilt from .data and .transform"
    )


@dataclass
class AdoptedData:
    """A user's loader rebuilt over a cache, and why it was built that way."""

    loader: SafeThreadDataLoader
    dataset: Any
    plan: CachePlan | None  #: ``None`` when the user's data set was already a cache
    where: str  #: "gpu", "ram", "disk", "smartcache", "none" or "user cache"
    notes: list[str] = field(default_factory=list)
    #: the user's data set, and its items as they were when copied into ``dataset`` (``None``: not copied)
    source: Any = None
    copied: list | None = None

    @property
    def smartcache(self) -> bool:
        """Whether the data set is a `SafeSmartCacheDataset`, which needs a ``SmartCacheUpdater``."""
        return isinstance(self.dataset, SafeSmartCacheDataset)

    def source_changed(self) -> bool:
        """Whether the user's data set no longer holds the items copied at adoption (the script replaced its
        ``data`` or an item of it): the adopted data set still serves the old ones."""
        if self.copied is None:
            return False
        now = getattr(self.source, "data", None)
        return now is None or len(now) != len(self.copied) or any(a is not b for a, b in zip(now, self.copied))


def why_not_adoptable(loader: Any, force_thread: bool = False) -> str | None:
    """The reason ``loader`` cannot be adopted, or ``None`` when it can."""
    if not isinstance(loader, DataLoader):
        return f"the engine's data is a {type(loader).__name__}, not a torch DataLoader"
    ds = loader.dataset
    if isinstance(ds, IterableDataset):
        return "the data set is an IterableDataset: there are no items to cache"
    if not isinstance(ds, _CACHES) and not (hasattr(ds, "data") and hasattr(ds, "transform")):
        return f"the data set ({type(ds).__name__}) has no .data and .transform (use a MONAI Dataset)"
    rebuilt = not isinstance(ds, _CACHES) or isinstance(loader.sampler, DistributedSampler)
    if rebuilt or isinstance(ds, SmartCacheDataset):
        why = unknown_item_path(ds, rotation=isinstance(ds, SmartCacheDataset))
        if why is not None and rebuilt:
            return why
    if type(loader.batch_sampler).__name__ != "BatchSampler":
        return f"a custom batch sampler ({type(loader.batch_sampler).__name__}) decides the batches"
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler, DistributedSampler)):
        return f"a custom sampler ({type(loader.sampler).__name__}) decides the order"
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler.num_samples != len(ds)):
        return (
            f"the RandomSampler draws {sampler.num_samples} of {len(ds)} items"
            f"{' with replacement' if sampler.replacement else ''}: a shuffle would change the epoch's items"
        )
    if not force_thread and loader.collate_fn not in THREAD_SAFE_COLLATES:
        name = getattr(loader.collate_fn, "__qualname__", type(loader.collate_fn).__name__)
        return (
            f"the collate function {name} is not known to be thread-safe "
            "(pass loader='thread' to run it in the loader thread anyway)"
        )
    return None


def _order(loader: DataLoader) -> tuple[list | None, bool, torch.Generator | None, str]:
    """The items this rank sees, whether to shuffle them, the generator, and a note."""
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        items = rank_partition(list(loader.dataset.data), sampler.rank, sampler.num_replicas, seed=sampler.seed)
        note = (
            f"DistributedSampler -> this rank's partition ({len(items)} of {len(loader.dataset.data)} items, "
            f"rank {sampler.rank} of {sampler.num_replicas}), cached by this rank only"
        )
        return items, sampler.shuffle, None, note
    if isinstance(sampler, RandomSampler):
        return None, True, sampler.generator, "shuffled as before"
    return None, False, None, "in order, as before"


def adopt_loader(
    loader: DataLoader,
    device: str | torch.device = "cpu",
    cache: str = "auto",
    *,
    gpu_budget_mib: float | None = None,
    ram_budget_mib: float | None = None,
    disk_budget_mib: float | None = None,
    cache_dir: str | os.PathLike | None = None,
    cache_threads: int | None = None,
    progress: bool = False,
    force_thread: bool = False,
    background: bool = False,
    after: Any = None,
) -> AdoptedData:
    """Rebuild ``loader`` over a planned cache, keeping its batches (docs/data.md).

    Args:
        loader: the user's loader.
        device: the training device (a CUDA device allows a GPU cache).
        cache: ``"auto"`` (the planner decides), or a place of `CACHE_PLACES` to force one.
        gpu_budget_mib, ram_budget_mib, disk_budget_mib: MiB; ``None``: the planner's defaults.
        cache_dir: where a disk cache may go.
        cache_threads: threads filling the cache; default the CPUs.
        progress: a progress bar while the cache fills.
        force_thread: run a collate function not known to be thread-safe in the loader thread.
        background: a GPU or RAM cache fills in the background while training runs.
        after: the trainer's background-filled data set, which this (the evaluator's) fill waits for.

    Raises:
        ValueError: the loader cannot be adopted (the reason names what is in the way), or ``cache`` is unknown.

    Examples:
        >>> trainer.data_loader = adopt_loader(trainer.data_loader, device="cuda").loader  # doctest: +SKIP
    """
    budgets_in_bytes({"gpu": gpu_budget_mib, "ram": ram_budget_mib, "disk": disk_budget_mib})  # a bad one fails first
    if cache not in CACHE_CHOICES:
        raise ValueError(f"cache must be one of {', '.join(map(repr, CACHE_CHOICES))}, got {cache!r}")
    if (why := why_not_adoptable(loader, force_thread)) is not None:
        raise ValueError(why)
    ds, device = loader.dataset, torch.device(device)
    # a list the data set holds (not one it makes on each access) can be watched for the script's changes
    held = getattr(ds, "data", None)
    copied = list(held) if isinstance(held, list) and held is getattr(ds, "data", None) else None
    shared = _shared_node_tier(loader, device, cache, cache_dir, disk_budget_mib) if cache in ("auto", "disk") else None
    if shared is not None:
        return replace(shared, source=ds, copied=copied)
    items, shuffle, generator, order_note = _order(loader)
    # building caches and MONAI loaders reseeds the transforms (Compose.__init__, DataLoader.__init__):
    # put their generators and torch's back, so the adopted loader draws the crops the user's would
    with _random_states_kept(ds):
        if isinstance(ds, SmartCacheDataset) and (
            items is not None  # a rank's partition; else a MONAI one with MONAI's item path and rotation
            or (not isinstance(ds, SafeSmartCacheDataset) and unknown_item_path(ds, rotation=True) is None)
        ):
            share = (
                1.0
                if items is None  # each rank rotates its share of the window
                else min(1.0, math.ceil(ds.cache_num / loader.sampler.num_replicas) / max(1, ds.cache_num))
            )
            window_dir = _window_tier(ds, cache, cache_dir, ram_budget_mib, disk_budget_mib, share)
            dataset, plan, where, workers, notes = _adopt_smartcache(ds, items, loader.sampler, window_dir)
        elif isinstance(ds, _CACHES) and items is None:
            dataset, plan, where, workers = ds, None, "user cache", 0
            notes = [f"the data set is already a {type(ds).__name__}: kept, only the loader changes"]
            why = unknown_item_path(ds, rotation=True) if isinstance(ds, SmartCacheDataset) else None
            if why is not None:
                notes[0] += f" (its rotation is left to the script's own handlers: {why})"
        else:
            data, chain = items if items is not None else list(ds.data), _chain(ds.transform)
            plan = plan_cache(
                chain,
                data,
                device,
                gpu_budget_mib=gpu_budget_mib,
                ram_budget_mib=ram_budget_mib,
                disk_budget_mib=disk_budget_mib,
                cache_dir=cache_dir,
            )
            plan = plan if cache == "auto" else force_plan(plan, cache)
            dataset, where = _build(plan, data, chain, cache_threads, progress, background, after), plan.where
            workers = 0 if plan.where in ("gpu", "ram", "smartcache") else loader.num_workers
            notes = [plan.reasons[-1]]
        new = _rebuilt_loader(loader, dataset, workers, **fill_order_options(dataset, shuffle, generator))
    repeats = f", repeats={new.repeats}" if new.repeats != 1 else ""
    notes.append(
        f"SafeThreadDataLoader(batch_size={loader.batch_size}, {order_note}, drop_last={loader.drop_last}{repeats}, "
        f"{workers} worker processes)"
    )
    followed = dataset is not ds and not isinstance(dataset, SafeSmartCacheDataset)  # a window rotates on its own
    return AdoptedData(new, dataset, plan, where, notes, source=ds, copied=copied if followed else None)


def _shared_node_tier(
    loader: DataLoader,
    device: torch.device,
    cache: str,
    cache_dir: str | os.PathLike | None,
    disk_budget_mib: float | None,
) -> AdoptedData | None:
    """Under a ``DistributedSampler``: the user's sampler over one `CropCacheDataset` per node, or ``None``."""
    sampler, ds = loader.sampler, loader.dataset
    if not isinstance(sampler, DistributedSampler) or cache_dir is None or device.type == "cuda":
        return None
    if type(ds) is not Dataset or not ds.data:  # a cache of the user's own is adopted as before
        return None
    transform = _chain(ds.transform)
    plan = plan_cache(
        transform, list(ds.data), device, ram_budget_mib=0, disk_budget_mib=disk_budget_mib, cache_dir=cache_dir
    )
    if not plan.reads_patches or (cache == "auto" and plan.where != "disk"):
        return None
    with _random_states_kept(ds):
        dataset = CropCacheDataset(ds.data, ds.transform, cache_dir=cache_dir)
        shared_by_nodes = idist.get_nnodes() > 1 and _seen_by_every_node(Path(cache_dir))
        if shared_by_nodes:  # one file system for the whole job: the job's ranks split the fill, one copy in all
            share, copies = range(idist.get_rank(), len(dataset), idist.get_world_size()), "the job"
        else:
            share, copies = range(idist.get_local_rank(), len(dataset), max(1, idist.get_nproc_per_node())), "the node"
        written = dataset.fill(share)
        if idist.get_world_size() > 1:
            idist.barrier()  # every rank reads items the others wrote (a dead rank ends this with the group's timeout)
        new = _rebuilt_loader(loader, dataset, 0, sampler=sampler)
    notes = [
        f"DistributedSampler kept (rank {sampler.rank} of {sampler.num_replicas}, shuffle={sampler.shuffle}, "
        f"seed {sampler.seed}): every rank reads every item from one CropCacheDataset "
        f"{'shared by all ' + str(idist.get_nnodes()) + ' nodes' if shared_by_nodes else 'per node'} in {cache_dir} "
        f"(the {type(transform.transforms[plan.first_random]).__name__} reads its patch from the memory map; "
        f"{len(dataset)} items, this rank wrote {written} of {copies}'s one copy), so the node's page cache holds "
        "one copy",
        f"SafeThreadDataLoader(batch_size={loader.batch_size}, the user's DistributedSampler, "
        f"drop_last={loader.drop_last}, 0 worker processes)",
    ]
    return AdoptedData(new, dataset, plan, "disk", notes)


def _seen_by_every_node(folder: Path) -> bool:
    """Whether every node sees the same ``folder``: each node's first rank leaves a mark, every rank looks for all
    the nodes' marks, and all ranks agree (collective)."""
    token = idist.broadcast(secrets.token_hex(8) if idist.get_rank() == 0 else "", src=0)
    marks = folder / ".nodes"
    mark = marks / f"{token}-{idist.get_node_rank()}"
    marked = 1
    if idist.get_local_rank() == 0:
        try:
            marks.mkdir(parents=True, exist_ok=True)
            mark.touch()
        except OSError:  # a read-only or full folder: no mark, and so no shared copy; never a rank left waiting
            marked = 0
    marked = int(idist.all_reduce(marked, op="MIN"))  # also the barrier: every node's mark is down
    seen = bool(marked) and all((marks / f"{token}-{k}").exists() for k in range(idist.get_nnodes()))
    shared = bool(idist.all_reduce(int(seen), op="MIN"))  # also the barrier: every rank has looked
    if idist.get_local_rank() == 0:
        with contextlib.suppress(OSError):
            mark.unlink(missing_ok=True)
    return shared


def _rebuilt_loader(loader: DataLoader, dataset: Any, workers: int, **order: Any) -> SafeThreadDataLoader:
    """A `SafeThreadDataLoader` over ``dataset`` with the user's batches and options kept; ``order``: its sampler
    or shuffle."""
    options: dict[str, Any] = {}
    if isinstance(loader, ThreadDataLoader):
        options.update(repeats=loader.repeats, buffer_size=loader.buffer_size, buffer_timeout=loader.buffer_timeout)
    if isinstance(loader, SafeThreadDataLoader):
        options["timeout_s"] = loader.timeout_s
    if workers > 0:
        kept = (*WORKER_OPTIONS, "timeout")
        options.update({name: getattr(loader, name) for name in kept if hasattr(loader, name)})
    return SafeThreadDataLoader(
        dataset,
        batch_size=loader.batch_size,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        num_workers=workers,
        **options,
        **order,
    )


def _window_tier(
    ds: SmartCacheDataset,
    cache: str,
    cache_dir: str | os.PathLike | None,
    ram_budget_mib: float | None,
    disk_budget_mib: float | None,
    share: float = 1.0,
) -> tuple[str | os.PathLike, str] | None:
    """Where a SmartCache's window rotates over a crop-reading tier, and why; ``None``: in RAM (docs/data.md)."""
    if isinstance(ds, SafeSmartCacheDataset) and ds.tier is not None:
        return ds.cache_dir, "as it was built"
    if cache_dir is None or cache not in ("auto", "disk"):
        return None
    chain = _chain(ds.transform)
    first = first_random(chain.transforms)
    if first == len(chain.transforms) or not isinstance(chain.transforms[first], PATCH_CROPS):
        return None
    window = window_bytes(ds)
    ram, disk = budgets_in_bytes({"ram": ram_budget_mib, "disk": disk_budget_mib})
    ram = default_ram_budget() if ram is None else ram
    if cache == "auto" and window * share <= ram:  # the window fits: the folder is not even made
        return None
    disk = default_disk_budget(cache_dir) if disk is None else disk
    if window / max(1, ds.cache_num) * len(ds.data) * 1.2 > disk:  # every item is written once, with the margin
        return None
    if cache == "disk":
        return cache_dir, "cache='disk'"
    return (
        cache_dir,
        f"its window holds {window * share / 2**20:.1f} MiB, more than the RAM budget of {ram / 2**20:.1f} MiB",
    )


def _adopt_smartcache(
    ds: SmartCacheDataset, items: list | None, sampler: Any, tier: tuple[str | os.PathLike, str] | None = None
) -> tuple[Any, None, str, int, list[str]]:
    """``ds`` as a `SafeSmartCacheDataset` (over this rank's ``items``), its window over ``tier``'s folder if given."""
    timeout = ds._rotation.timeout_s if isinstance(ds, SafeSmartCacheDataset) else 300.0
    cache_dir = None if tier is None else tier[0]
    if items is None:
        safe = SafeSmartCacheDataset.adopt(ds, timeout_s=timeout, cache_dir=cache_dir)
        note = (
            f"the data set is a MONAI {type(ds).__name__}: its items, window of {safe.cache_num}, "
            f"{safe.replace_num} replacements per epoch and random state adopted into a SafeSmartCacheDataset "
            "(bounded waits, named errors, resumable); the cached window handed over, no second cache. The adopted "
            "data set rotates, not the user's object: SafeSmartCacheDataset.adoption_of(it) finds it, and a "
            "later attach over the same data set goes on with its rotation"
        )
    else:
        share = min(len(items), math.ceil(ds.cache_num / sampler.num_replicas))
        safe = SafeSmartCacheDataset.adopt(ds, data=items, cache_num=share, timeout_s=timeout, cache_dir=cache_dir)
        note = (
            f"the data set is a {type(ds).__name__}: this rank rotates its partition in a SafeSmartCacheDataset "
            f"caching {share} of the window's {ds.cache_num} items, {safe.replace_num} replaced per epoch"
        )
    if safe.tier is not None and tier is not None:
        note += (
            f"; the window rotates over a crop-reading tier in {tier[0]} ({tier[1]}): it holds item numbers, each "
            "item's cached part is written there once and each random crop reads only its patch"
        )
    return safe, None, "smartcache", 0, [note]


def _build(
    plan: CachePlan, data: list, transform: Any, cache_threads: int | None, progress: bool, background: bool, after: Any
) -> Any:
    spare = (os.cpu_count() or 2) - 1 if background and plan.where in ("gpu", "ram") else (os.cpu_count() or 1)
    threads = cache_threads if cache_threads is not None else max(1, spare)  # background: the trainer keeps a core
    kwargs: dict = {}
    if plan.where in ("gpu", "ram"):
        kwargs.update(num_workers=threads, progress=show_progress(progress))
        if background and isinstance(after, BackgroundCacheDataset):
            kwargs["after"] = after
    elif plan.where == "smartcache":
        kwargs.update(num_init_workers=threads, num_replace_workers=threads, progress=show_progress(progress))
    return plan.build(data, transform, background=background, **kwargs)


@contextlib.contextmanager
def _random_states_kept(dataset: Any) -> Iterator[None]:
    """Restore torch's global generator and the generators of the random transforms under ``dataset``."""
    randoms = randomizables(dataset)  # nested ones too (RandCropByPosNegLabeld's cropper has its own R)
    states = [t.R.get_state() for t in randoms]
    torch_state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        for t, s in zip(randoms, states):
            t.R.set_state(s)
