"""What a recipe trains, as one object: network, loss, optimizer, transform chains, precision, layout.

A recipe's builder assembles engines and data sets from its `RecipeParts`; the tuner
(`monai_fast.apps.recipes.tuning.tune_recipe()`) times the same parts, so it tunes exactly what the recipe
trains. `monai_fast.apps.recipes.recipe_parts()` gives a registered recipe's parts by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from monai.transforms import Compose, MapTransform

from monai_fast.apps.recipes.common import build_network, build_optimizer
from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.transforms import deterministic_transforms, random_transforms
from monai_fast.telemetry.precision import check_precision

__all__ = ["RecipeParts", "contiguous"]


def contiguous(precision: str) -> torch.memory_format:
    """The default layout whatever the precision (recipes that keep PyTorch's layout)."""
    return torch.contiguous_format


@dataclass(frozen=True)
class RecipeParts:
    """The parts of one recipe for one config and device.

    Attributes:
        name: recipe name.
        config: the options, the recipe's defaults filled in (``with_defaults``).
        device: where training runs.
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (`monai_fast.telemetry.precision`).
        precision_by: who runs the precision: ``"monai"``, MONAI's own ``amp=True`` (CUDA fp16
            autocast + scaler), or ``"toggle"``, an `AMPToggle` on
            trainer and evaluator.
        loss_factory: builds the training loss.
        cache_form: the deterministic chain ends in a cache's form (crop indices precomputed,
            plain tensors) and the random crop uses those indices.
        memory_format: the weights' layout for a precision (see `network()`).

    Examples:
        >>> from monai_fast.apps.recipes import RecipeConfig, recipe_parts
        >>> parts = recipe_parts("monai_tutorial", RecipeConfig(), "cpu")
        >>> parts.config.optimizer, parts.precision
        ('novograd', 'fp32')
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
        """The deterministic head of the training chain (what a cache holds).

        Args:
            to_device: end with ``ToDeviced`` to `device` (a cache in GPU memory).
        """
        return deterministic_transforms(
            self.config,
            precompute_indices=self.cache_form,
            plain_tensors=self.cache_form,
            device=self.device if to_device else None,
        )

    def random_transforms(self) -> list[MapTransform]:
        """The random tail of the training chain: crops and augmentation."""
        return random_transforms(self.config, precomputed_indices=self.cache_form)

    def train_transforms(self, to_device: bool = False) -> Compose:
        """The whole training chain, deterministic head then random tail."""
        return Compose(self.cached_transforms(to_device) + self.random_transforms())

    def val_transforms(self, to_device: bool = False) -> Compose:
        """The validation chain: the deterministic transforms, no crop indices."""
        return Compose(
            deterministic_transforms(
                self.config, plain_tensors=self.cache_form, device=self.device if to_device else None
            )
        )
