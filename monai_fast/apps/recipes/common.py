"""Parts every recipe shares: the built recipe, the network, and the trainer/evaluator assembly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import MeanDice, ValidationHandler, from_engine
from monai.inferers import SimpleInferer, SlidingWindowInferer
from monai.networks.layers import Norm
from monai.networks.nets import SegResNet, UNet
from monai.optimizers import Novograd
from monai.transforms import AsDiscreted, Compose, ToDeviced
from monai.utils import set_determinism
from torch.utils.data import DataLoader, Subset

from monai_fast.apps.recipes.config import DEFAULT_LR, RecipeConfig
from monai_fast.distributed.model import distribute
from monai_fast.handlers.validation_schedule import ValidationSchedule, estimator_like

__all__ = [
    "VAL_METRIC",
    "Recipe",
    "assemble",
    "attach_validation_schedule",
    "build_network",
    "build_optimizer",
    "resolve_amp",
]

logger = logging.getLogger(__name__)

VAL_METRIC = "val_mean_dice"
#: residual blocks per down-sampling level of MONAI's SegResNet (its default; deeper levels take the last)
SEGRESNET_BLOCKS_DOWN = (1, 2, 2, 4)


@dataclass
class Recipe:
    """A ready-to-run training set-up: call ``recipe.trainer.run()``.

    Attributes:
        name: recipe name.
        trainer: MONAI ``SupervisedTrainer``; validation runs through a ``ValidationHandler``.
        evaluator: MONAI ``SupervisedEvaluator`` whose key metric is ``val_mean_dice`` (mean Dice
            without background).
        network, optimizer, loss_function: what the trainer uses.
        train_loader, val_loader: the data loaders.
        device: where training runs.
        amp: whether mixed precision is on.
        setup_s: seconds spent building, cache filling included.
        notes: what the recipe chose and why, one line each.
    """

    name: str
    trainer: SupervisedTrainer
    evaluator: SupervisedEvaluator
    network: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_function: Callable
    train_loader: DataLoader
    val_loader: DataLoader
    device: torch.device
    amp: bool
    config: RecipeConfig
    setup_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def build_optimizer(config: RecipeConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``config.optimizer`` at ``config.lr`` (or that optimizer's default learning rate).

    ``config.optimizer`` must be set; recipes fill it with their own through ``with_defaults``.

    Examples:
        >>> net = torch.nn.Linear(2, 2)
        >>> build_optimizer(RecipeConfig(optimizer="adamw"), net.parameters()).param_groups[0]["lr"]
        0.003
    """
    if config.optimizer is None:
        raise ValueError("build_optimizer needs config.optimizer; use config.with_defaults(optimizer=...)")
    lr = config.lr or DEFAULT_LR[config.optimizer]
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr)  # PyTorch's default weight decay, 0.01
    return Novograd(params, lr=lr)


def resolve_amp(config: RecipeConfig, device: torch.device, default_on_cuda: bool) -> bool:
    """Whether MONAI's fp16 ``amp`` is on: ``config.precision`` ``"fp16"`` on CUDA, ``"fp32"`` off,
    ``"auto"``: ``default_on_cuda`` on CUDA and off on a CPU.

    ``"bf16"`` is taken as ``"auto"`` with one warning: MONAI's ``amp=True`` runs fp16 autocast only,
    and a race applies one precision request to every recipe (``fast`` honours bf16).
    """
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
    """``config.network`` sized by ``config``: MONAI's 3D ``UNet`` with batch norm (as in MONAI's spleen
    tutorials) or its ``SegResNet`` (``init_filters=channels[0]``, one level per entry of ``channels``).

    Examples:
        >>> cfg = RecipeConfig(network="segresnet", channels=(16, 32, 64, 128), dropout=0.2)
        >>> type(build_network(cfg, torch.device("cpu"))).__name__
        'SegResNet'
    """
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


def seed_everything(config: RecipeConfig) -> None:
    """Seed Python, NumPy and torch; leaves cuDNN free to pick fast (non-deterministic) kernels."""
    set_determinism(seed=config.seed)
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = True


def assemble(
    name: str,
    config: RecipeConfig,
    device: torch.device,
    network: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_function: Callable,
    train_loader: DataLoader,
    val_loader: DataLoader,
    amp: bool,
    t_start: float,
    notes: Sequence[str] = (),
    train_handlers: Sequence = (),
) -> Recipe:
    """Build the evaluator (sliding window, mean Dice) and the trainer that validates with it."""
    # one process: unchanged; DDP: the trainer gets the DDP module, the evaluator the bare one
    # (inference needs no gradient sync); Horovod: its DistributedOptimizer
    network, optimizer = distribute(network, optimizer)
    bare = getattr(network, "module", network)
    stitch_on = _stitch_device(config, device)
    post = _postprocessing(stitch_on)
    evaluator = SupervisedEvaluator(
        device=device,
        val_data_loader=val_loader,
        network=bare,
        inferer=SlidingWindowInferer(
            roi_size=config.patch_size,
            sw_batch_size=config.sw_batch_size,
            overlap=config.sw_overlap,
            sw_device=device,
            device=stitch_on,
        ),
        postprocessing=post,
        key_val_metric=_val_metric(),
        amp=amp,
        compile=config.compile,
    )
    trainer = SupervisedTrainer(
        device=device,
        max_epochs=config.max_epochs,
        train_data_loader=train_loader,
        network=network,
        optimizer=optimizer,
        loss_function=loss_function,
        inferer=SimpleInferer(),
        # on a schedule, compose attaches a ValidationSchedule once the evaluator's data is final
        train_handlers=(
            [ValidationHandler(validator=evaluator, interval=config.val_interval)]
            if config.validation in (None, "every_epoch")
            else []
        )
        + list(train_handlers),
        amp=amp,
        optim_set_to_none=True,
        compile=config.compile,
    )
    return Recipe(
        name=name,
        trainer=trainer,
        evaluator=evaluator,
        network=network,
        optimizer=optimizer,
        loss_function=loss_function,
        train_loader=train_loader,
        val_loader=val_loader,
        device=device,
        amp=amp,
        config=config,
        setup_s=time.perf_counter() - t_start,
        notes=list(notes),
    )


def _stitch_device(config: RecipeConfig, device: torch.device) -> torch.device | None:
    """Where the sliding-window output is stitched when not where the network runs (``None``: there)."""
    stitch_on = torch.device(config.val_device) if config.val_device else None
    return None if stitch_on is None or stitch_on.type == device.type else stitch_on


def _postprocessing(stitch_on: torch.device | None) -> Compose:
    """Argmax and one-hot for the Dice metric; with the output stitched off the device, the label follows it."""
    return Compose(
        ([ToDeviced(keys=["pred", "label"], device=stitch_on)] if stitch_on is not None else [])
        + [AsDiscreted(keys="pred", argmax=True, to_onehot=2), AsDiscreted(keys="label", to_onehot=2)]
    )


def _val_metric() -> dict:
    return {VAL_METRIC: MeanDice(include_background=False, output_transform=from_engine(["pred", "label"]))}


def attach_validation_schedule(recipe: Recipe) -> ValidationSchedule:
    """A `ValidationSchedule` on ``recipe``'s trainer, as
    ``config.validation="schedule"`` asks.

    The estimate is the mean Dice on the first ``config.val_subset`` items of the evaluator's
    (final) data set, with the evaluator's network, inferer and precision.

    Examples:
        >>> attach_validation_schedule(recipe).every  # doctest: +SKIP
        5
    """
    config, evaluator = recipe.config, recipe.evaluator
    dataset = evaluator.data_loader.dataset
    subset = DataLoader(Subset(dataset, range(min(config.val_subset, len(dataset)))), batch_size=1, num_workers=0)
    estimator = estimator_like(evaluator, subset, _val_metric(), _postprocessing(_stitch_device(config, recipe.device)))
    schedule = ValidationSchedule(
        evaluator,
        estimator,
        target=config.val_target,
        margin=config.val_margin,
        every=config.val_every,
        metric_name=VAL_METRIC,
    )
    schedule.attach(recipe.trainer)
    return schedule
