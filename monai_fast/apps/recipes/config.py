"""Options shared by all recipes, validated once, and the size a tutorial notebook runs at.

A notebook's ``SIZE`` is ``"test"`` (about a minute on a CPU), ``"full"`` (sized for a GPU) or
``"auto"`` (`tutorial_size()`); see docs/notebooks.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace

import torch

from monai_fast.data.planner import CACHE_CHOICES
from monai_fast.telemetry import cuda_available
from monai_fast.telemetry.precision import check_precision

__all__ = ["DEFAULT_LR", "NETWORKS", "OPTIMIZERS", "TUTORIAL_SIZES", "RecipeConfig", "tutorial_device", "tutorial_size"]

#: what a notebook's ``SIZE`` parameter accepts
TUTORIAL_SIZES = ("test", "full", "auto")
#: optimizers a recipe can be given by name, and the learning rate each gets when ``lr`` is unset
OPTIMIZERS = ("adam", "adamw", "novograd")
DEFAULT_LR = {"adam": 1e-4, "adamw": 3e-3, "novograd": 2e-3}
#: the networks a recipe can train (MONAI's ``UNet`` and ``SegResNet``)
NETWORKS = ("unet", "segresnet")
#: SegResNet's group norm splits the first level's features into this many groups
SEGRESNET_GROUPS = 8
#: the least value of each numeric option (``None`` is the recipe's own choice)
_MINIMUMS = {
    **dict.fromkeys(("batch_size", "num_samples", "sw_batch_size", "val_interval", "max_epochs", "val_every"), 1),
    "val_subset": 1,
    **dict.fromkeys(("num_res_units", "val_margin", "cache_budget_mib", "num_workers", "cache_threads"), 0),
}


@dataclass
class RecipeConfig:
    """What a recipe is built from besides its files and device; a bad value is refused here, named.

    Args:
        patch_size, batch_size, num_samples: training crop and sliding-window ROI (voxels after resampling);
            volumes per batch; crops per volume (``None``: the recipe's `RecipeSpec.defaults`, as below).
        network, channels, strides, num_res_units, dropout: one of `NETWORKS` and its shape.
        pixdim, intensity_window, optimizer, lr: spacing (mm); CT window (HU); one of `OPTIMIZERS`; its rate.
        sw_batch_size, sw_overlap, val_device: sliding-window batch, overlap and stitching device.
        val_interval, validation, max_epochs: validate every this many epochs, or on a schedule
            (``validation="schedule"``: ``val_target``, ``val_every``, ``val_margin``, ``val_subset``).
        num_workers, cache_threads, precision, compile: loader workers; cache-filling threads; one of
            `REQUESTS` (``"auto"``: the recipe's default); compile the network with ``torch.compile``.
        cache, cache_dir, cache_budget_mib, background_fill: ``fast``'s cache place (``"auto"`` or one of
            `CACHE_PLACES`), disk folder, memory budget, and filling while training runs.
        seed: seed for weights, crops and augmentation.

    Examples:
        >>> RecipeConfig(channels=(16, 32, 64, 128), strides=(2, 2, 2)).channels
        (16, 32, 64, 128)
    """

    patch_size: tuple[int, int, int] = (64, 64, 64)
    batch_size: int | None = None
    num_samples: int | None = None
    network: str = "unet"
    channels: tuple[int, ...] = (8, 16, 32, 64)
    strides: tuple[int, ...] = (2, 2, 2)
    num_res_units: int = 1
    dropout: float = 0.0
    pixdim: tuple[float, float, float] = (1.5, 1.5, 2.0)
    intensity_window: tuple[float, float] = (-57.0, 164.0)
    optimizer: str | None = None
    lr: float | None = None
    sw_batch_size: int = 4
    sw_overlap: float = 0.25
    val_device: str | None = None
    val_interval: int = 1
    validation: str | None = None
    val_target: float = 0.9
    val_every: int = 5
    val_margin: float = 0.1
    val_subset: int = 2
    max_epochs: int = 100
    num_workers: int | None = None
    cache_threads: int | None = None
    precision: str = "auto"
    compile: bool = False
    cache: str = "auto"
    cache_dir: str | None = None
    cache_budget_mib: float | None = None
    background_fill: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name, kind in (("patch_size", int), ("channels", int), ("strides", int), ("pixdim", float)):
            setattr(self, name, tuple(kind(v) for v in getattr(self, name)))
        self.intensity_window = tuple(float(w) for w in self.intensity_window)  # type: ignore[assignment]
        self.dropout = float(self.dropout)
        if len(self.patch_size) != 3 or min(self.patch_size) < 8:
            raise ValueError(f"patch_size must be three sizes >= 8, got {self.patch_size}")
        down = math.prod(self.strides)
        if any(p % down for p in self.patch_size):
            raise ValueError(f"patch_size {self.patch_size} must be divisible by the network's total stride {down}")
        if len(self.channels) < 2 or min(self.channels) < 1:
            raise ValueError(
                f"channels must be two or more levels of >= 1 features (the UNet goes down at least "
                f"once), got {self.channels}"
            )
        if len(self.channels) != len(self.strides) + 1:
            raise ValueError(f"channels {self.channels} needs exactly one more entry than strides {self.strides}")
        if self.network not in NETWORKS:
            raise ValueError(f"network must be one of {NETWORKS}, got {self.network!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.network == "segresnet" and any(s != 2 for s in self.strides):
            raise ValueError(
                f"network 'segresnet' halves the size at every level: strides must all be 2, got {self.strides}"
            )
        doubling = tuple(self.channels[0] * 2**i for i in range(len(self.channels)))
        if self.network == "segresnet" and (self.channels[0] % SEGRESNET_GROUPS or self.channels != doubling):
            like = doubling if self.channels[0] % SEGRESNET_GROUPS == 0 else (16, 32, 64, 128)
            raise ValueError(
                f"network 'segresnet' doubles its features per level from init_filters=channels[0], a "
                f"multiple of {SEGRESNET_GROUPS} (its group norm): channels must be like {like}, "
                f"got {self.channels}"
            )
        for name, low in _MINIMUMS.items():
            if getattr(self, name) is not None and not getattr(self, name) >= low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not 0.0 <= self.sw_overlap < 1.0:
            raise ValueError(f"sw_overlap must be in [0, 1), got {self.sw_overlap}")
        if len(self.pixdim) != 3 or not all(math.isfinite(p) and p > 0 for p in self.pixdim):
            raise ValueError(f"pixdim must be three finite voxel sizes > 0 (mm), got {self.pixdim}")
        if len(self.intensity_window) != 2 or not all(math.isfinite(w) for w in self.intensity_window):
            raise ValueError(f"intensity_window must be two finite numbers (low, high), got {self.intensity_window}")
        if self.intensity_window[0] >= self.intensity_window[1]:
            raise ValueError(f"intensity_window must be (low, high) with low < high, got {self.intensity_window}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS} or None, got {self.optimizer!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.val_device is not None:
            try:
                torch.device(self.val_device)
            except RuntimeError as exc:
                raise ValueError(f"val_device {self.val_device!r} is not a device name: {exc}") from None
        if self.validation not in (None, "every_epoch", "schedule"):
            raise ValueError(
                f"validation must be 'every_epoch' or 'schedule' (or None: the recipe's default); "
                f"got {self.validation!r}"
            )
        if self.cache not in CACHE_CHOICES:
            raise ValueError(f"cache must be one of {', '.join(CACHE_CHOICES)}; got {self.cache!r}")
        check_precision(self.precision, allow_auto=True)
        if self.cache == "disk" and not self.cache_dir:
            raise ValueError("cache='disk' needs cache_dir")

    @property
    def loader_workers(self) -> int:
        return self.num_workers if self.num_workers is not None else min(4, os.cpu_count() or 1)

    @property
    def cache_thread_count(self) -> int:
        """``cache_threads``, or the number of CPUs when it is ``None``."""
        return self.cache_threads if self.cache_threads is not None else (os.cpu_count() or 1)

    def with_defaults(self, **defaults: object) -> RecipeConfig:
        """A copy in which each option named in ``defaults`` that is ``None`` takes the given value."""
        _check_known(defaults)
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def tuned(
        self,
        batch_size: int,
        sw_batch_size: int,
        val_device: str,
        precision: str,
        cache_budget_mib: float | None = None,
    ) -> RecipeConfig:
        """A copy with a tuner's pick (`monai_fast.tune.TuneResult.apply()` calls this).

        A mixed ``precision`` keeps this config's request (``"auto"`` for fp32); a ``None`` budget keeps its own.
        """
        return replace(
            self,
            batch_size=batch_size,
            sw_batch_size=sw_batch_size,
            val_device=val_device,
            precision="fp32" if precision == "fp32" else (self.precision if self.precision != "fp32" else "auto"),
            cache_budget_mib=self.cache_budget_mib if cache_budget_mib is None else cache_budget_mib,
        )

    def to_dict(self) -> dict:
        """The options as a plain dict (``from_dict`` takes it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RecipeConfig:
        """Build from a dict, rejecting unknown keys by name."""
        _check_known(d)
        return cls(**d)


def _check_known(options: Mapping[str, object]) -> None:
    known = {f.name for f in fields(RecipeConfig)}
    if unknown := sorted(set(options) - known):
        raise ValueError(f"unknown recipe option(s) {unknown}; known: {sorted(known)}")


def tutorial_device() -> torch.device:
    """The device the tutorials train on: the CUDA GPU when one is usable, else the CPU."""
    return torch.device("cuda" if cuda_available() else "cpu")


def tutorial_size(size: str = "auto", device: torch.device | str | None = None) -> str:
    """``"test"`` or ``"full"``: ``size`` itself, or for ``"auto"`` the size ``device`` runs in minutes.

    ``size`` is a notebook's ``SIZE`` (one of `TUTORIAL_SIZES`, else a ``ValueError``); ``device`` defaults
    to `tutorial_device()`.
    """
    if size not in TUTORIAL_SIZES:
        raise ValueError(f"SIZE must be one of {TUTORIAL_SIZES}, got {size!r}")
    if size != "auto":
        return size
    return "full" if torch.device(device if device is not None else tutorial_device()).type == "cuda" else "test"
