"""The data pieces of the recipes: where the deterministic transforms' output lives, and who loads it.

Every chain is a `NamedItemsCompose`: an unreadable file raises one `DataItemError` naming it (docs/data.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from monai.data import CacheDataset, DataLoader, Dataset, ThreadDataLoader
from monai.transforms import Compose

from monai_fast.apps.recipes.parts import RecipeParts
from monai_fast.data.safe_chain import NamedItemsCompose, threads_joined_on_error
from monai_fast.progress import show_progress

__all__ = ["DataPiece", "guide_cached_data", "require_device", "uncached_data"]


def require_device(device: torch.device) -> None:
    """Raise one clear ``ValueError`` when ``device`` is CUDA and there is none, before any data is read."""
    from monai_fast.telemetry import cuda_available

    if device.type == "cuda" and not cuda_available():
        raise ValueError(f"device {str(device)!r}: this torch build or machine has no CUDA device; use device='cpu'")


@dataclass
class DataPiece:
    """Training and validation data of a recipe.

    Attributes:
        train_ds, train_loader, val_ds, val_loader: what the engines iterate.
        where: where the training data is cached, in words; empty when nothing is cached.
        on_gpu: the cached items live in GPU memory.
    """

    train_ds: Dataset
    train_loader: DataLoader
    val_ds: Dataset
    val_loader: DataLoader
    where: str
    on_gpu: bool = False

    def note(self) -> str:
        """One line: data set class, where it lives, sizes and the loader."""
        loader = f"{type(self.train_loader).__name__}({self.train_loader.num_workers} workers)"
        if not self.where:
            return f"{type(self.train_ds).__name__} + {loader}: all transforms every epoch"
        return (
            f"{type(self.train_ds).__name__} in {self.where} ({len(self.train_ds)} train + {len(self.val_ds)} val "
            f"items), {loader}"
        )


def uncached_data(parts: RecipeParts, train_files: Sequence[dict], val_files: Sequence[dict]) -> DataPiece:
    """``Dataset`` + multi-process ``DataLoader``: every transform runs every epoch."""
    require_device(parts.device)
    kw = {"num_workers": parts.config.loader_workers, "pin_memory": parts.device.type == "cuda"}
    train_ds = Dataset(data=list(train_files), transform=NamedItemsCompose.of(parts.train_transforms()))
    val_ds = Dataset(data=list(val_files), transform=NamedItemsCompose.of(parts.val_transforms()))
    train_loader = DataLoader(train_ds, batch_size=parts.config.batch_size, shuffle=True, **kw)
    return DataPiece(train_ds, train_loader, val_ds, DataLoader(val_ds, batch_size=1, **kw), where="")


def guide_cached_data(
    parts: RecipeParts, train_files: Sequence[dict], val_files: Sequence[dict], progress: bool = True
) -> DataPiece:
    """MONAI's guide: ``CacheDataset`` of everything, in GPU memory on CUDA, else RAM; a thread loader."""
    require_device(parts.device)
    on_gpu = parts.device.type == "cuda"
    train_ds = _cache(parts, train_files, parts.train_transforms(to_device=on_gpu), progress)
    train_loader = ThreadDataLoader(train_ds, num_workers=0, batch_size=parts.config.batch_size, shuffle=True)
    val_ds = _cache(parts, val_files, parts.val_transforms(to_device=on_gpu), progress)
    val_loader = ThreadDataLoader(val_ds, num_workers=0, batch_size=1)
    where = f"GPU memory ({parts.device})" if on_gpu else "CPU RAM"
    return DataPiece(train_ds, train_loader, val_ds, val_loader, where=where, on_gpu=on_gpu)


def _cache(parts: RecipeParts, files: Sequence[dict], chain: Compose, progress: bool) -> CacheDataset:
    """Everything cached as MONAI's guide does; a failing file named, the fill's threads finished first."""
    with threads_joined_on_error():
        return CacheDataset(
            data=list(files),
            transform=NamedItemsCompose.of(chain),
            cache_rate=1.0,
            num_workers=parts.config.cache_thread_count,
            copy_cache=False,
            progress=show_progress(progress),
        )
