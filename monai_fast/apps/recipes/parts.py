"""What a recipe trains, as one object (what the tuner times too): network, optimizer, loss, precision, layout."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from monai.losses import DiceCELoss, DiceLoss
from monai.networks.layers import Norm
from monai.networks.nets import SegResNet, UNet
from monai.optimizers import Novograd
from monai.transforms import Compose, MapTransform

from monai_fast.apps.recipes.config import DEFAULT_LR, RecipeConfig
from monai_fast.apps.recipes.transforms import deterministic_transforms, random_transforms
from monai_fast.telemetry.precision import check_precision

__all__ = [
    "RecipeParts",
    "build_network",
    "build_optimizer",
    "contiguous",
    "dice_ce_loss",
    "dice_loss",
    "memory_format_for",
    "resolve_amp",
]

logger = logging.getLogger(__name__)

#: residual blocks per down-sampling level of MONAI's SegResNet (its default; deeper levels take the last)
SEGRESNET_BLOCKS_DOWN = (1, 2, 2, 4)


def contiguous(precision: str) -> torch.memory_format:
    """The default layout whatever the precision (recipes that keep PyTorch's layout)."""
    return torch.contiguous_format


@dataclass(frozen=True)
class RecipeParts:
    """The parts of one recipe for one config and device.

    Attributes:
        name, config: recipe name; the options, the recipe's defaults filled in (``with_defaults``).
        device, precision: where training runs; ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        precision_by: ``"monai"`` (MONAI's own ``amp=True``: CUDA fp16) or ``"toggle"`` (an `AMPToggle`).
        loss_factory: builds the training loss.
        cache_form: the deterministic chain ends in a cache's form and the random crop uses its indices.
        memory_format: the weights' layout for a precision (see `network()`).
    """

    name: str
    config: RecipeConfig
    device: torch.device
    precision: str
    precision_by: str
    loss_factory: Callable[[], Callable]
    cache_form: bool = False
    memory_format: Callable[[str], torch.memory_format] = contiguous

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if self.precision_by not in ("monai", "toggle"):
            raise ValueError(f"precision_by must be 'monai' or 'toggle', got {self.precision_by!r}")
        if self.precision_by == "monai" and self.precision == "bf16":
            raise ValueError("MONAI's amp=True runs fp16 autocast; use precision_by='toggle' for bf16")

    @property
    def monai_amp(self) -> bool:
        """Whether MONAI's ``amp=True`` is on in the engines."""
        return self.precision_by == "monai" and self.precision != "fp32"

    @property
    def channels_last(self) -> bool:
        """Whether the weights are in ``channels_last_3d`` at this recipe's precision."""
        return self.memory_format(self.precision) == torch.channels_last_3d

    def network(self, device: torch.device | str | None = None) -> torch.nn.Module:
        """The UNet on ``device`` (default `device`), weights in the recipe's layout."""
        net = build_network(self.config, torch.device(device) if device is not None else self.device)
        fmt = self.memory_format(self.precision)
        return net if fmt == torch.contiguous_format else net.to(memory_format=fmt)

    def loss(self) -> Callable:
        """A fresh training loss."""
        return self.loss_factory()

    def optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The recipe's optimizer over ``params`` (``config.optimizer`` at ``config.lr``)."""
        return build_optimizer(self.config, params)

    def cached_transforms(self, to_device: bool = False) -> list[MapTransform]:
        """The deterministic head of the training chain (what a cache holds); ``to_device``: then to `device`."""
        form, device = self.cache_form, self.device if to_device else None
        return deterministic_transforms(self.config, precompute_indices=form, plain_tensors=form, device=device)

    def random_transforms(self) -> list[MapTransform]:
        """The random tail of the training chain: crops and augmentation."""
        return random_transforms(self.config, precomputed_indices=self.cache_form)

    def train_transforms(self, to_device: bool = False) -> Compose:
        """The whole training chain, deterministic head then random tail."""
        return Compose(self.cached_transforms(to_device) + self.random_transforms())

    def val_transforms(self, to_device: bool = False) -> Compose:
        """The validation chain: the deterministic transforms, no crop indices."""
        device = self.device if to_device else None
        return Compose(deterministic_transforms(self.config, plain_tensors=self.cache_form, device=device))


def build_optimizer(config: RecipeConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``config.optimizer`` (the recipe's ``with_defaults`` sets it) at ``config.lr`` or its default rate."""
    if config.optimizer is None:
        raise ValueError("build_optimizer needs config.optimizer; use config.with_defaults(optimizer=...)")
    optimizer = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "novograd": Novograd}[config.optimizer]
    return optimizer(params, lr=config.lr or DEFAULT_LR[config.optimizer])  # AdamW: PyTorch's weight decay, 0.01


def resolve_amp(config: RecipeConfig, device: torch.device, default_on_cuda: bool) -> bool:
    """Whether MONAI's fp16 ``amp`` is on: ``"fp16"`` on CUDA, ``"fp32"`` off, ``"auto"`` (and ``"bf16"``, with
    a warning: MONAI's ``amp`` is fp16 only) ``default_on_cuda`` on CUDA and off on a CPU."""
    if config.precision == "bf16":
        logger.warning(
            "precision 'bf16': this recipe runs MONAI's amp, which is fp16 autocast only; it takes its automatic "
            "choice instead (%s)",
            "MONAI's amp on" if default_on_cuda and device.type == "cuda" else "fp32",
        )
    if config.precision in ("auto", "bf16"):
        return default_on_cuda and device.type == "cuda"
    if config.precision == "fp16" and device.type != "cuda":
        logger.warning("precision 'fp16' needs a CUDA device; training in fp32 on %s", device)
        return False
    return config.precision == "fp16"


def build_network(config: RecipeConfig, device: torch.device, out_channels: int = 2) -> torch.nn.Module:
    """``config.network`` sized by ``config``: MONAI's 3D ``UNet`` with batch norm, or its ``SegResNet``."""
    if config.network == "segresnet":
        levels = len(config.channels)
        return SegResNet(
            spatial_dims=3,
            in_channels=1,
            out_channels=out_channels,
            init_filters=config.channels[0],
            dropout_prob=config.dropout or None,
            blocks_down=tuple(SEGRESNET_BLOCKS_DOWN[min(i, len(SEGRESNET_BLOCKS_DOWN) - 1)] for i in range(levels)),
            blocks_up=(1,) * (levels - 1),
        ).to(device)
    return UNet(
        spatial_dims=3,
        in_channels=1,
        out_channels=out_channels,
        channels=config.channels,
        strides=config.strides,
        num_res_units=config.num_res_units,
        norm=Norm.BATCH,
        dropout=config.dropout,
    ).to(device)


def dice_loss() -> Callable:
    """``DiceLoss`` on softmax outputs against an integer label map (MONAI's spleen tutorial)."""
    return DiceLoss(to_onehot_y=True, softmax=True)


def dice_ce_loss() -> Callable:
    """``DiceCELoss`` with squared prediction and batch Dice (MONAI's fast-training guide)."""
    return DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, batch=True)


def memory_format_for(device: torch.device, precision: str) -> torch.memory_format:
    """``channels_last_3d`` weights, except on a CPU in bf16 (measured slower: ``benchmarks/README.md``)."""
    if device.type == "cpu" and precision == "bf16":
        return torch.contiguous_format
    return torch.channels_last_3d
