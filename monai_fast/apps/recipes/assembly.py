"""A recipe's data, and its parts and data put together: trainer, evaluator, precision, validation schedule.

Every data chain is a `NamedItemsCompose`: an unreadable file raises one `DataItemError` naming it (docs/data.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from monai.data import CacheDataset, DataLoader, Dataset, ThreadDataLoader
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import MeanDice, ValidationHandler, from_engine
from monai.inferers import SimpleInferer, SlidingWindowInferer
from monai.transforms import AsDiscreted, Compose, ToDeviced
from monai.utils import set_determinism
from torch.utils.data import Subset

from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.parts import RecipeParts
from monai_fast.data.items import NamedItemsCompose, threads_joined_on_error
from monai_fast.distributed.model import distribute
from monai_fast.handlers.fast_training import FastTraining
from monai_fast.handlers.guards import NonFiniteGuard
from monai_fast.handlers.validation_schedule import ValidationSchedule, estimator_like
from monai_fast.progress import show_progress
from monai_fast.telemetry import cuda_available

__all__ = [
    "VAL_METRIC",
    "DataPiece",
    "Recipe",
    "attach_validation_schedule",
    "compose",
    "fast_training",
    "guide_cached_data",
    "require_device",
    "seed_everything",
    "uncached_data",
]

VAL_METRIC = "val_mean_dice"


def require_device(device: torch.device) -> None:
    """Raise one clear ``ValueError`` when ``device`` is CUDA and there is none, before any data is read."""
    if device.type == "cuda" and not cuda_available():
        raise ValueError(f"device {str(device)!r}: this torch build or machine has no CUDA device; use device='cpu'")


@dataclass
class DataPiece:
    """Training and validation data of a recipe.

    Attributes:
        train_ds, train_loader, val_ds, val_loader: what the engines iterate.
        where: where the training data is cached, in words; empty when nothing is cached.
    """

    train_ds: Dataset
    train_loader: DataLoader
    val_ds: Dataset
    val_loader: DataLoader
    where: str

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
    return DataPiece(train_ds, train_loader, val_ds, val_loader, where=where)


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


@dataclass
class Recipe:
    """A ready-to-run training set-up: call ``recipe.trainer.run()``.

    Attributes:
        name, config: recipe name; the options it was built with.
        trainer: MONAI ``SupervisedTrainer``; validation runs through a ``ValidationHandler`` or a schedule.
        evaluator: MONAI ``SupervisedEvaluator``; key metric ``val_mean_dice`` (mean Dice without background).
        network, optimizer, loss_function, train_loader, val_loader: what the engines use.
        device, amp: where training runs; whether mixed precision is on.
        setup_s: seconds spent building, cache filling included.
        notes: what the recipe chose and why, one line each.
        fast_training: the `FastTraining` attached (the ``fast`` recipe), else ``None``.
    """

    name: str
    trainer: SupervisedTrainer
    evaluator: SupervisedEvaluator
    network: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_function: Callable
    train_loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    device: torch.device
    amp: bool
    config: RecipeConfig
    setup_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    fast_training: FastTraining | None = None


def seed_everything(config: RecipeConfig) -> None:
    """Seed Python, NumPy and torch; leaves cuDNN free to pick fast (non-deterministic) kernels."""
    set_determinism(seed=config.seed)
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = True


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
    """A `ValidationSchedule` on ``recipe``'s trainer, as ``config.validation="schedule"`` asks; its estimate is
    the mean Dice on the first ``config.val_subset`` items of the evaluator's data."""
    config, evaluator = recipe.config, recipe.evaluator
    dataset = evaluator.data_loader.dataset
    first_items = Subset(dataset, range(min(config.val_subset, len(dataset))))
    subset = torch.utils.data.DataLoader(first_items, batch_size=1, num_workers=0)
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


def compose(parts: RecipeParts, data: DataPiece, t_start: float, levers: FastTraining | None = None) -> Recipe:
    """Network, optimizer, loss and engines from ``parts`` over ``data``, precision applied.

    With ``levers`` (needed for ``parts.precision_by == "toggle"``, refused for ``"monai"``: a ``ValueError``),
    that `FastTraining` is attached to both engines and sets the precision; without, MONAI's own ``amp`` does.
    Every trainer gets a ``NonFiniteGuard``.
    """
    if (parts.precision_by == "toggle") != (levers is not None):
        raise ValueError(
            f"recipe {parts.name!r}: precision_by={parts.precision_by!r} "
            f"{'needs' if levers is None else 'cannot take'} a FastTraining to apply it"
        )
    config, device, amp = parts.config, parts.device, parts.monai_amp
    network = parts.network()  # after the data sets, so the seed's random stream is the same as always
    optimizer = parts.optimizer(network.parameters())
    loss = parts.loss()
    lr = optimizer.param_groups[0]["lr"]
    precision_note = f"AMP {'on' if amp else 'off'}" if levers is None else f"precision {parts.precision}"
    notes = [
        data.note()
        if levers is None
        else f"built over {type(data.train_ds).__name__} + {type(data.train_loader).__name__}, "
        "then adopted by FastTraining",
        f"batch {config.batch_size} x {config.num_samples} crops, {type(loss).__name__}, "
        f"{type(optimizer).__name__}(lr={lr:g}), {precision_note}"
        + (", channels_last_3d weights" if parts.channels_last else ""),
    ]
    # DDP: the trainer gets the DDP module, the evaluator the bare one; Horovod: its DistributedOptimizer
    network, optimizer = distribute(network, optimizer)
    stitch_on = _stitch_device(config, device)
    evaluator = SupervisedEvaluator(
        device=device,
        val_data_loader=data.val_loader,
        network=getattr(network, "module", network),
        inferer=SlidingWindowInferer(
            roi_size=config.patch_size,
            sw_batch_size=config.sw_batch_size,
            overlap=config.sw_overlap,
            sw_device=device,
            device=stitch_on,
        ),
        postprocessing=_postprocessing(stitch_on),
        key_val_metric=_val_metric(),
        amp=amp,
        compile=config.compile,
    )
    every_epoch = config.validation in (None, "every_epoch")  # else a ValidationSchedule is attached below
    handlers = [ValidationHandler(validator=evaluator, interval=config.val_interval)] if every_epoch else []
    trainer = SupervisedTrainer(
        device=device,
        max_epochs=config.max_epochs,
        train_data_loader=data.train_loader,
        network=network,
        optimizer=optimizer,
        loss_function=loss,
        inferer=SimpleInferer(),
        train_handlers=handlers,
        amp=amp,
        optim_set_to_none=True,
        compile=config.compile,
    )
    loaders = data.train_loader, data.val_loader
    recipe = Recipe(
        parts.name, trainer, evaluator, network, optimizer, loss, *loaders, device, amp, config, notes=notes
    )
    NonFiniteGuard().attach(trainer)  # before AMPToggle, which then falls back through it
    if levers is not None:
        levers.attach(trainer, evaluator)
        recipe.fast_training = levers
        recipe.train_loader, recipe.val_loader = trainer.data_loader, evaluator.data_loader
        recipe.amp = levers.applied["precision"]["applied"]
        recipe.notes.extend(
            f"FastTraining {lever}: {what['setting'] if what['applied'] else 'left alone'} ({what['reason']})"
            for lever, what in levers.applied.items()
        )
    if config.validation == "schedule":
        attach_validation_schedule(recipe)
        recipe.notes.append(
            f"validation on a schedule: Dice on {config.val_subset} case(s) every epoch, the full validation "
            f"every {config.val_every} epochs until that is within {config.val_margin:g} of {config.val_target:g}"
        )
    recipe.setup_s = time.perf_counter() - t_start
    return recipe


def fast_training(parts: RecipeParts, progress: bool = False) -> FastTraining:
    """The `FastTraining` the ``fast`` recipe attaches: its cache options, precision and layout."""
    config, on_cuda = parts.config, parts.device.type == "cuda"
    budget = config.cache_budget_mib
    return FastTraining(
        cache=config.cache,
        precision=parts.precision,
        memory_format="channels_last_3d" if parts.channels_last else "contiguous",
        gpu_budget_mib=budget if on_cuda else None,
        ram_budget_mib=None if on_cuda else budget,
        cache_dir=config.cache_dir,
        cache_threads=config.cache_threads,
        background_fill=config.background_fill,
        progress=progress,
    )
