"""Tumour / normal patch classification on whole-slide images: the plain pipeline and the fast one.

After MONAI's pathology tumour-detection example, built two ways on the same patches: ``plain``
(MONAI as installed) and ``fast``; neither ends an epoch short. docs/pathology.md describes both.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from ignite.metrics import Accuracy
from monai.data import DataLoader, PatchWSIDataset
from monai.engines import SupervisedEvaluator, SupervisedTrainer, default_prepare_batch
from monai.handlers import ROCAUC, ValidationHandler, from_engine
from monai.networks.nets import DenseNet
from monai.optimizers import Novograd
from monai.transforms import (
    Activationsd,
    CastToTyped,
    Compose,
    RandFlipd,
    RandRotate90d,
    RandScaleIntensityd,
    ScaleIntensityRanged,
)
from monai.utils import set_determinism

from monai_fast.apps.recipes.pathology_augment import AugmentingPrepareBatch, batch_augment, cucim_status, to_unit_range
from monai_fast.apps.sources.wsi_reader import BACKENDS, WSIBackend, choose_wsi_backend
from monai_fast.data.loaders import SafeThreadDataLoader
from monai_fast.data.preflight import preflight_wsi
from monai_fast.handlers import AMPToggle, RecordHandler, ThroughputMonitor, TimeBreakdown, TimeToTarget
from monai_fast.handlers.guards import EpochLengthGuard
from monai_fast.handlers.preemption import end_of_setup, stop_signals_caught
from monai_fast.telemetry.precision import check_precision

__all__ = [
    "METRIC",
    "SIZES",
    "VARIANTS",
    "PathologyConfig",
    "PathologyRun",
    "PathologySize",
    "build_pathology",
    "results_table",
    "run_pathology",
    "summarize",
]

logger = logging.getLogger(__name__)

VARIANTS = ("plain", "fast")
#: the validation metric the target is on
METRIC = "val_auc"


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


@dataclass
class PathologyRun:
    """A built pipeline: its engines, network, loaders, handlers and what it chose (``notes``)."""

    variant: str
    trainer: SupervisedTrainer
    evaluator: SupervisedEvaluator
    network: torch.nn.Module
    stopper: TimeToTarget
    throughput: ThroughputMonitor
    breakdown: TimeBreakdown
    amp: AMPToggle | None
    notes: dict[str, str]
    setup_s: float


def _plain_transforms(train: bool, prob: float) -> Compose:
    """Per-patch CPU transforms, MONAI's dictionary transforms in the loader workers."""
    augment = [
        RandScaleIntensityd(keys="image", factors=0.25, prob=1.0),
        RandFlipd(keys="image", prob=prob, spatial_axis=1),
        RandRotate90d(keys="image", prob=prob, max_k=3),
    ]
    return Compose(
        [
            CastToTyped(keys="image", dtype=torch.float32),
            *(augment if train else []),
            ScaleIntensityRanged(keys="image", a_min=0.0, a_max=255.0, b_min=-1.0, b_max=1.0, clip=True),
        ]
    )


def _loaders(
    variant: str,
    train: Sequence[dict],
    val: Sequence[dict],
    config: PathologyConfig,
    device: torch.device,
    reader: WSIBackend,
    notes: dict[str, str],
) -> tuple[Any, Any]:
    """The training and validation loaders of ``variant``, reading with ``reader``."""
    if variant == "plain":
        notes["reader"] = "tifffile (MONAI's TiffFileWSIReader: whole-level decode per patch)"
        notes["augment"] = "MONAI per-patch transforms in loader workers (CPU)"
        loader, workers = DataLoader, config.workers
        transforms = [_plain_transforms(t, config.prob) for t in (True, False)]
        notes["loader"] = f"DataLoader ({workers} worker processes)"
    else:
        notes["reader"] = ("tifffile, tile-aware" if reader.name == "tifffile" else reader.name) + f" ({reader.why})"
        # one thread reads tiles fast enough for a CPU, not for a GPU (docs/pathology.md)
        loader, workers, transforms = SafeThreadDataLoader, config.workers if device.type == "cuda" else 0, [None, None]
        notes["loader"] = (
            f"SafeThreadDataLoader ({workers} worker processes)" if workers else "SafeThreadDataLoader (one thread)"
        )
    kw = {"batch_size": config.batch_size, "num_workers": workers, "persistent_workers": workers > 0}
    train_ds, val_ds = (
        PatchWSIDataset(list(d), patch_size=config.patch_size, patch_level=0, transform=t, reader=reader.make(level=0))
        for d, t in zip((train, val), transforms)
    )
    return loader(train_ds, shuffle=True, **kw), loader(val_ds, **kw)


def _engines(
    variant: str,
    loaders: tuple[Any, Any],
    network: torch.nn.Module,
    config: PathologyConfig,
    device: torch.device,
    notes: dict[str, str],
) -> tuple[SupervisedTrainer, SupervisedEvaluator]:
    """MONAI's trainer and evaluator: BCE on one logit, ROC AUC and accuracy on the sigmoid."""
    fast = variant == "fast"
    prepare: Callable[..., Any] = default_prepare_batch
    if fast:
        why = cucim_status(device)
        notes["augment"] = "cuCIM GPU kernels (RandCuCIM)" if why is None else f"torch batch ops on {device} ({why})"
        prepare = AugmentingPrepareBatch(batch_augment(device, config.prob, quiet=True))
    stack = from_engine(["pred", "label"])

    def binary(out: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pred, label = (torch.stack(list(t)) for t in stack(out))
        return (pred > 0.5).long(), label.long()

    evaluator = SupervisedEvaluator(
        device=device,
        val_data_loader=loaders[1],
        network=network,
        # plain: the loader's batches are float in [-1, 1] already, only moved to the device
        prepare_batch=AugmentingPrepareBatch(to_unit_range if fast else lambda x: x),
        postprocessing=Activationsd(keys="pred", sigmoid=True),
        key_val_metric={METRIC: ROCAUC(output_transform=stack)},
        additional_metrics={"val_acc": Accuracy(output_transform=binary)},
    )
    params = network.parameters()  # plain: the example's baseline, SGD with momentum
    optimizer = Novograd(params, lr=config.lr) if fast else torch.optim.SGD(params, lr=config.lr, momentum=0.9)
    notes["optimizer"] = type(optimizer).__name__
    trainer = SupervisedTrainer(
        device=device,
        max_epochs=config.max_epochs,
        train_data_loader=loaders[0],
        network=network,
        optimizer=optimizer,
        loss_function=torch.nn.BCEWithLogitsLoss(),
        train_handlers=[ValidationHandler(validator=evaluator, interval=1, epoch_level=True)],
        prepare_batch=prepare,
    )
    return trainer, evaluator


def build_pathology(
    variant: str,
    train: Sequence[dict],
    val: Sequence[dict],
    config: PathologyConfig | None = None,
    device: torch.device | str = "cpu",
    target: float = 0.95,
    time_budget_s: float | None = None,
    run_dir: str | os.PathLike | None = None,
    start_time: float | None = None,
) -> PathologyRun:
    """Build ``variant`` (one of `VARIANTS`) on the patch lists of `load_wsi_datalist()`.

    Args:
        train, val: ``{"image", "location", "label"}`` patch dicts (a centre at level 0).
        config, device: the options (default `PathologyConfig`); where the network trains.
        target: validation ROC AUC at which ``TimeToTarget`` stops training.
        time_budget_s, start_time: wall-clock limit (``None``: none) counted from ``start_time``
            (``time.perf_counter()`` when the clock started; default now).
        run_dir: if given, ``run_dir/<variant>/`` receives the run record (``RecordHandler``).

    Raises:
        ValueError: for an unknown ``variant`` or a bad option.
        monai_fast.apps.sources.wsi_reader.WSIBackendError: ``config.backend`` cannot run here (named).
        monai_fast.data.preflight.PreflightError: a bad slide or patch location (each named).
    """
    t0 = time.perf_counter() if start_time is None else start_time
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    config = config or PathologyConfig()
    device = torch.device(device)
    set_determinism(config.seed)
    notes: dict[str, str] = {}
    reader = choose_wsi_backend("tifffile-monai" if variant == "plain" else config.backend, device, quiet=True)
    if config.preflight:  # a bad slide or location is named here, not in a loader thread in the middle of an epoch
        preflight_wsi({"training": train, "validation": val}, config.patch_size, reader=reader.make(level=0))
    loaders = _loaders(variant, train, val, config, device, reader, notes)
    network = DenseNet(  # RGB in, one logit (tumour) out
        spatial_dims=2,
        in_channels=3,
        out_channels=1,
        init_features=config.init_features,
        growth_rate=config.growth_rate,
        block_config=tuple(config.block_config),
    ).to(device)
    trainer, evaluator = _engines(variant, loaders, network, config, device, notes)
    # first among the epoch's handlers: no validation, AUC or checkpoint comes from an epoch that ended short
    EpochLengthGuard("training").attach(trainer)
    EpochLengthGuard("validation").attach(evaluator)
    amp = AMPToggle(config.precision) if variant == "fast" else None
    if amp is not None:
        amp.attach(trainer)
        AMPToggle(amp.precision).attach(evaluator)  # the trainer's choice, not measured twice
    notes["precision"] = amp.precision if amp is not None else "fp32"
    breakdown, throughput = TimeBreakdown(), ThroughputMonitor(log_every_epoch=False)
    breakdown.attach(trainer)
    throughput.attach(trainer)
    stopper = TimeToTarget(
        target, METRIC, time_budget_s=time_budget_s, start_time=t0, logger=logging.getLogger(f"{__name__}.{variant}")
    )
    stopper.attach(trainer, evaluator)
    if run_dir is not None:
        record = RecordHandler(Path(run_dir) / variant)
        record.attach(trainer)
        record.attach(evaluator)
    setup_s = time.perf_counter() - t0
    logger.info("%s: %s", variant, "; ".join(f"{k}: {v}" for k, v in notes.items()))
    return PathologyRun(variant, trainer, evaluator, network, stopper, throughput, breakdown, amp, notes, setup_s)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(run: PathologyRun, total_s: float) -> dict[str, Any]:
    """What a finished run measured: patches/s, data share, AUC, accuracy, time to target, its choices."""
    epochs = [e["samples_per_s"] for e in run.throughput.epochs]
    steady = epochs[1:] or epochs  # the first epoch pays for loader start-up and first-call costs
    history = run.stopper.history
    return {
        "variant": run.variant,
        **run.notes,
        "epochs": run.trainer.state.epoch,
        "patches_per_s": _median(steady),
        "patches_per_s_by_epoch": epochs,
        "data_share": _median([ep.data_share for ep in run.trainer.state.time_breakdown]),
        "best_auc": run.stopper.best,
        "final_auc": history[-1][2] if history else None,
        "final_acc": run.evaluator.state.metrics.get("val_acc"),
        "target_auc": run.stopper.target,
        "time_to_target_s": run.stopper.reached_s,
        "epoch_at_target": run.stopper.reached_epoch,
        "setup_s": run.setup_s,
        "total_s": total_s,
        "history": [{"s": s, "epoch": e, "auc": v} for s, e, v in history],
    }


def run_pathology(
    variant: str,
    train: Sequence[dict],
    val: Sequence[dict],
    config: PathologyConfig | None = None,
    *args: Any,
    **kwargs: Any,
) -> dict[str, Any]:
    """Build and train ``variant`` to ``target`` AUC (or ``config.max_epochs`` / the budget); `summarize()` it.

    Arguments as `build_pathology()`, but the clock starts here; a stop signal during the set-up exits with 143.

    Examples:
        >>> result = run_pathology("fast", train, val, SIZES["tiny"].config(), "cpu", target=0.9)  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    with stop_signals_caught():  # a signal while the slides are checked, the data sets and engines built: kept
        run = build_pathology(variant, train, val, config, *args, **kwargs, start_time=t0)
        end_of_setup()  # a program's own catcher too: a signal since its start stops it here, saying so
    try:
        run.trainer.run()
        out = summarize(run, time.perf_counter() - t0)
    finally:
        # reference cycles keep persistent loader workers alive: collected here, not in the next run's forked worker
        del run
        gc.collect()
    out["config"] = asdict(config or PathologyConfig())
    return out


def results_table(results: Sequence[dict[str, Any]]) -> str:
    """Runs (from `run_pathology()`) as a markdown table; ratios against the ``plain`` run of the same repeat."""

    def cell(v: float | None, fmt: str, unit: str = "") -> str:
        return "-" if v is None else format(v, fmt) + unit

    target = results[0].get("target_auc", 0.0) if results else 0.0
    lines = [
        f"| variant | repeat | patches/s | data wait | epochs | best AUC | time to AUC {target:g} "
        "| patches/s vs plain | time to target vs plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        repeat = r.get("repeat", 1)
        plain = next((p for p in results if p["variant"] == "plain" and p.get("repeat", 1) == repeat), None)
        speed = time_ratio = ""
        if plain is not None and r is not plain:
            if r["patches_per_s"] and plain["patches_per_s"]:
                speed = f"{r['patches_per_s'] / plain['patches_per_s']:.2f}x"
            if r["time_to_target_s"] and plain["time_to_target_s"]:
                time_ratio = f"{plain['time_to_target_s'] / r['time_to_target_s']:.2f}x as fast"
        share = None if r["data_share"] is None else 100 * r["data_share"]
        lines.append(
            f"| {r['variant']} | {repeat} | {cell(r['patches_per_s'], '.1f')} | {cell(share, '.1f', ' %')} "
            f"| {r['epochs']} | {cell(r['best_auc'], '.3f')} | {cell(r['time_to_target_s'], '.1f', ' s')} "
            f"| {speed} | {time_ratio} |"
        )
    return "\n".join(lines)
