"""The options of the pathology pipelines (`monai_fast.apps.recipes.pathology`) and their sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from monai_fast.apps.sources.wsi_reader import BACKENDS
from monai_fast.telemetry.precision import check_precision

__all__ = ["SIZES", "PathologyConfig", "PathologySize"]


@dataclass(frozen=True)
class PathologyConfig:
    """Options of both pipelines; sizes come from `SIZES` (``SIZES[name].config()``).

    Args:
        patch_size, batch_size: patch side at level 0, in pixels; patches per batch.
        init_features, growth_rate, block_config: MONAI ``DenseNet`` width and depth.
        max_epochs, lr: epochs at most; learning rate (Novograd in ``fast``, SGD with momentum 0.9 in ``plain``).
        precision: ``fast``'s ``AMPToggle`` request (``"auto"``, ``"bf16"``, ``"fp16"``, ``"fp32"``).
        workers: loader worker processes of ``plain``, and of ``fast`` on a GPU (on a CPU it reads in a thread).
        backend: ``fast``'s WSI backend (`monai_fast.apps.sources.wsi_reader.BACKENDS`).
        prob, seed: probability of the flip and of the rotation; seed of weights, shuffling and augmentation.
        preflight: check every slide and patch location before training (`preflight_wsi()`).
    """

    patch_size: int = 64
    batch_size: int = 32
    init_features: int = 16
    growth_rate: int = 16
    block_config: tuple[int, ...] = (2, 4, 4)
    max_epochs: int = 5
    lr: float = 1e-3
    precision: str = "auto"
    workers: int = 2
    backend: str = "auto"
    prob: float = 0.5
    seed: int = 0
    preflight: bool = True

    def __post_init__(self) -> None:
        for name in ("patch_size", "batch_size", "init_features", "growth_rate", "max_epochs"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0.0 <= self.prob <= 1.0:
            raise ValueError(f"prob must be in [0, 1], got {self.prob}")
        check_precision(self.precision, allow_auto=True)


@dataclass(frozen=True)
class PathologySize:
    """One size of the task: the synthetic slides and the pipeline options."""

    slides: int
    shape: tuple[int, int]
    tile: int
    levels: int
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def patch_size(self) -> int:
        return int(self.options.get("patch_size", PathologyConfig.patch_size))

    def config(self, **overrides: Any) -> PathologyConfig:
        """The `PathologyConfig` of this size, with ``overrides`` (``None`` values ignored)."""
        return PathologyConfig(**{**self.options, **{k: v for k, v in overrides.items() if v is not None}})


#: ``tiny``: seconds on a CPU (tests); ``cpu``: a few minutes on a laptop; ``gpu``: Camelyon-like patches
#: (224 pixels) and DenseNet-121's layout on a GPU
SIZES = {
    "tiny": PathologySize(
        3,
        (384, 384),
        128,
        2,
        dict(
            patch_size=32, batch_size=16, init_features=8, growth_rate=8, block_config=(2, 2), max_epochs=2, workers=1
        ),
    ),
    "cpu": PathologySize(
        4,
        (3072, 3072),
        256,
        3,
        dict(patch_size=64, batch_size=32, init_features=8, growth_rate=8, block_config=(2, 2, 2), max_epochs=6),
    ),
    "gpu": PathologySize(
        8,
        (8192, 8192),
        256,
        4,
        dict(
            patch_size=224,
            batch_size=64,
            init_features=64,
            growth_rate=32,
            block_config=(6, 12, 24, 16),
            max_epochs=10,
            workers=8,
        ),
    ),
}
