"""The data pieces of the recipes: where the deterministic transforms' output lives, and who loads it.

Each piece takes a recipe's :class:`~monai_fast.recipes.parts.RecipeParts` and the file lists
and returns a :class:`DataPiece`: training and validation data sets and loaders, and a note
saying what was built. ``uncached_data`` is plain MONAI; ``guide_cached_data`` is MONAI's
fast-training guide (everything cached, a thread loader); ``planned_cached_data`` puts the
training cache where :func:`~monai_fast.data.planner.plan_cache` measures it fits.

A file that cannot be read (a truncated NIfTI, say) ends the build or the epoch with one
:class:`~monai_fast.data.loaders.DataItemError` naming the file, in every cache mode and in loader
worker processes: every chain is a :class:`NamedItemsCompose`, and a failed cache fill waits for
the fill's other threads (:func:`threads_joined_on_error`) so the process can exit cleanly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from ignite.engine import Engine
from monai.data import CacheDataset, DataLoader, Dataset, ThreadDataLoader
from monai.transforms import Compose, ToDeviced

from monai_fast.data.loaders import DataItemError, error_text, item_files
from monai_fast.data.planner import CachePlan, plan_cache
from monai_fast.handlers.smartcache import SmartCacheUpdater
from monai_fast.recipes.parts import RecipeParts

__all__ = ["DataPiece", "NamedItemsCompose", "guide_cached_data", "planned_cached_data", "require_device",
           "threads_joined_on_error", "uncached_data"]


class NamedItemsCompose(Compose):
    """A ``Compose`` whose failure on an item that carries file names is a :class:`DataItemError` naming them.

    MONAI reports a failing transform as ``RuntimeError("applying transform <LoadImaged ...>")`` with
    the cause chained; the file is in neither. This chain raises
    ``DataItemError("transforming image=/d/a.nii.gz, label=/d/a_seg.nii.gz failed: EOFError: ...")``
    instead, in whatever thread or worker process runs it; items without file names (already
    loaded, without metadata) raise as before.

    Example:
        >>> from monai.transforms import LoadImaged
        >>> chain = NamedItemsCompose([LoadImaged(keys="image")])
        >>> chain({"image": "/no/such.nii.gz"})  # doctest: +SKIP
        DataItemError: transforming image=/no/such.nii.gz failed: ...
    """

    @classmethod
    def of(cls, chain: Compose) -> NamedItemsCompose:
        """The same transforms and settings as ``chain``, failures named."""
        return cls(chain.transforms, map_items=chain.map_items, unpack_items=chain.unpack_items, lazy=chain.lazy,
                   overrides=chain.overrides, log_stats=chain.log_stats)

    def __call__(self, input_: Any, start: int = 0, end: int | None = None, threading: bool = False,
                 lazy: bool | None = None) -> Any:
        try:
            return super().__call__(input_, start=start, end=end, threading=threading, lazy=lazy)
        except DataItemError:
            raise
        except Exception as e:
            files = item_files(input_)
            if not files:
                raise
            reason = error_text(e)
            raise DataItemError(f"transforming {files} failed: {reason}", reason=reason) from e


def require_device(device: torch.device) -> None:
    """Raise one clear ``ValueError`` when ``device`` is CUDA and this torch build or machine has none.

    Called first by every data piece, so ``build_recipe(..., device="cuda")`` on a CPU-only build
    fails before any data is read, not with torch's assert inside a transform.

    Example:
        >>> require_device(torch.device("cpu"))
    """
    from monai_fast.telemetry import cuda_available

    if device.type == "cuda" and not cuda_available():
        raise ValueError(f"device {str(device)!r}: this torch build or machine has no CUDA device; use device='cpu'")


@contextmanager
def threads_joined_on_error(timeout_s: float = 300.0) -> Iterator[None]:
    """On an error in the block, wait (at most ``timeout_s``) for the threads started in it, then re-raise.

    MONAI's ``CacheDataset`` fills its cache in a ``ThreadPool`` and, on the first failing item,
    terminates the pool without waiting: its other threads are still inside transforms (torch
    code) while the error unwinds, and a process that exits then aborts ("terminate called without
    an active exception", exit 134). Once they have finished their items they stop, and the error
    ends the process like any other.

    Example:
        >>> with threads_joined_on_error():  # doctest: +SKIP
        ...     ds = CacheDataset(files, chain, num_workers=4)
    """
    before = set(threading.enumerate())
    try:
        yield
    except BaseException:
        deadline = time.monotonic() + timeout_s
        for t in set(threading.enumerate()) - before:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        raise


@dataclass
class DataPiece:
    """Training and validation data of a recipe.

    Attributes:
        train_ds, train_loader, val_ds, val_loader: what the engines iterate.
        where: where the training data is cached, in words; empty when nothing is cached.
        on_gpu: the cached items live in GPU memory (validation follows the training cache).
        plan: the cache planner's decision (``planned_cached_data`` only).
    """

    train_ds: Dataset
    train_loader: DataLoader
    val_ds: Dataset
    val_loader: DataLoader
    where: str
    on_gpu: bool = False
    plan: CachePlan | None = None

    def note(self) -> str:
        """One line: data set class, where it lives, sizes and the loader."""
        loader = f"{type(self.train_loader).__name__}({self.train_loader.num_workers} workers)"
        if not self.where:
            return f"{type(self.train_ds).__name__} + {loader}: all transforms every epoch"
        return (f"{type(self.train_ds).__name__} in {self.where} ({len(self.train_ds)} train + {len(self.val_ds)} val "
                f"items), {loader}")

    def attach(self, trainer: Engine) -> None:
        """Attach what the data needs while training: a rotating SmartCache gets its updater."""
        if self.plan is not None and self.plan.where == "smartcache":
            SmartCacheUpdater(self.train_ds).attach(trainer)


def uncached_data(parts: RecipeParts, train_files: Sequence[dict], val_files: Sequence[dict]) -> DataPiece:
    """``Dataset`` + multi-process ``DataLoader``: every transform runs every epoch.

    Example:
        >>> data = uncached_data(parts, train_files, val_files)  # doctest: +SKIP
    """
    require_device(parts.device)
    config, pin = parts.config, parts.device.type == "cuda"
    train_ds = Dataset(data=list(train_files), transform=NamedItemsCompose.of(parts.train_transforms()))
    val_ds = Dataset(data=list(val_files), transform=NamedItemsCompose.of(parts.val_transforms()))
    workers = config.loader_workers
    train_loader = DataLoader(train_ds, batch_size=config.batch_size, shuffle=True, num_workers=workers, pin_memory=pin)
    val_loader = DataLoader(val_ds, batch_size=1, num_workers=workers, pin_memory=pin)
    return DataPiece(train_ds, train_loader, val_ds, val_loader, where="")


def guide_cached_data(
    parts: RecipeParts,
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    loader_cls: type[ThreadDataLoader] = ThreadDataLoader,
    progress: bool = True,
) -> DataPiece:
    """MONAI's guide: ``CacheDataset`` of everything, in GPU memory on CUDA, else RAM; a thread loader.

    Example:
        >>> data = guide_cached_data(parts, train_files, val_files, progress=False)  # doctest: +SKIP
    """
    require_device(parts.device)
    on_gpu = parts.device.type == "cuda"
    train_ds = _cache(parts, train_files, parts.train_transforms(to_device=on_gpu), progress)
    train_loader = loader_cls(train_ds, num_workers=0, batch_size=parts.config.batch_size, shuffle=True)
    val_ds, val_loader = _cached_val(parts, val_files, on_gpu, loader_cls, progress)
    where = f"GPU memory ({parts.device})" if on_gpu else "CPU RAM"
    return DataPiece(train_ds, train_loader, val_ds, val_loader, where=where, on_gpu=on_gpu)


def planned_cached_data(
    parts: RecipeParts,
    train_files: Sequence[dict],
    val_files: Sequence[dict],
    loader_cls: type[ThreadDataLoader] = ThreadDataLoader,
    progress: bool = True,
) -> DataPiece:
    """The training cache where the planner (or ``config.cache``) puts it; validation cached beside it.

    A cache in memory (GPU, RAM, SmartCache) feeds ``loader_cls`` with no worker processes; a
    disk cache or none gets ``config.loader_workers`` workers to keep up.

    Example:
        >>> data = planned_cached_data(parts, train_files, val_files, SafeThreadDataLoader)  # doctest: +SKIP
    """
    require_device(parts.device)
    config, device = parts.config, parts.device
    full = NamedItemsCompose.of(parts.train_transforms())
    plan = _plan(parts, train_files, full)
    kwargs: dict = {}
    if plan.where in ("gpu", "ram"):
        kwargs["num_workers"] = config.cache_threads
    elif plan.where == "smartcache":
        kwargs.update(num_init_workers=config.cache_threads, num_replace_workers=config.cache_threads)
    with threads_joined_on_error():
        if plan.where == "gpu":  # CachePlan.build's GPU chain, kept a NamedItemsCompose (build makes a plain one)
            chain = list(full.transforms)
            chain.insert(plan.first_random, ToDeviced(keys=plan.tensor_keys, device=plan.device))
            train_ds = CacheDataset(list(train_files), NamedItemsCompose(chain), cache_rate=1.0, copy_cache=False,
                                    progress=False, **kwargs)
        else:
            train_ds = plan.build(list(train_files), full, **kwargs)
    workers = 0 if plan.where in ("gpu", "ram", "smartcache") else config.loader_workers
    train_loader = loader_cls(train_ds, num_workers=workers, batch_size=config.batch_size, shuffle=True)
    on_gpu = plan.where == "gpu"  # validation follows the training cache onto the GPU, or not
    val_ds, val_loader = _cached_val(parts, val_files, on_gpu, loader_cls, progress)
    where = {"gpu": f"GPU memory ({device})", "ram": "CPU RAM", "disk": f"a disk cache in {plan.cache_dir}",
             "smartcache": f"a SmartCache of {plan.cache_num} items in RAM", "none": "no cache"}[plan.where]
    return DataPiece(train_ds, train_loader, val_ds, val_loader, where=where, on_gpu=on_gpu, plan=plan)


_PLAN_SAMPLE = 2  # items the planner loads to measure an item's cached size


def _plan(parts: RecipeParts, train_files: Sequence[dict], full) -> CachePlan:
    """The planner's measured place for the training cache, or the one ``config.cache`` forces."""
    config, device = parts.config, parts.device
    budget = None if config.cache_budget_mib is None else int(config.cache_budget_mib * 2**20)
    try:
        plan = plan_cache(
            full, list(train_files), device,
            gpu_budget=budget if device.type == "cuda" else None,
            ram_budget=budget if device.type != "cuda" else None,
            cache_dir=config.cache_dir, sample=_PLAN_SAMPLE,
        )
    except Exception:
        # the planner measured its samples through a plain Compose: find the failing one, named
        for item in list(train_files)[:_PLAN_SAMPLE]:
            NamedItemsCompose.of(full)(dict(item))
        raise
    if config.cache == "auto":
        return plan
    if config.cache == "gpu" and device.type != "cuda":
        raise ValueError(f"cache='gpu' needs a CUDA device, got {device}")
    forced: dict = {"where": config.cache}
    if config.cache == "smartcache":
        forced["cache_num"] = max(2, min(len(train_files), plan.cache_num or len(train_files) // 2))
    return replace(plan, **forced, reasons=[*plan.reasons, f"cache forced to {config.cache} by the recipe's options"])


def _cached_val(parts: RecipeParts, val_files: Sequence[dict], on_gpu: bool, loader_cls: type[ThreadDataLoader],
                progress: bool) -> tuple[CacheDataset, ThreadDataLoader]:
    ds = _cache(parts, val_files, parts.val_transforms(to_device=on_gpu), progress)
    return ds, loader_cls(ds, num_workers=0, batch_size=1)


def _cache(parts: RecipeParts, files: Sequence[dict], chain: Compose, progress: bool) -> CacheDataset:
    """Everything cached as MONAI's guide does; a failing file named, the fill's threads finished first."""
    with threads_joined_on_error():
        return CacheDataset(data=list(files), transform=NamedItemsCompose.of(chain), cache_rate=1.0,
                            num_workers=parts.config.cache_threads, copy_cache=False, progress=progress)
