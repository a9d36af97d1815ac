"""The single-GPU SegResNet lab: one run of a recipe around MONAI's SegResNet, its images and its measured table.

``tutorials/segresnet_lab.py`` and ``tutorials/segresnet_lab.ipynb`` are two front ends of `run_lab()`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ignite.engine import Engine, Events
from monai.handlers import from_engine
from monai.visualize import plot_2d_or_3d_image

from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.apps.training.run import TargetRun, TrainResult
from monai_fast.extras import require
from monai_fast.files import atomic_write, write_json, write_text
from monai_fast.telemetry import device_description
from monai_fast.telemetry.memory import DeviceMemory
from monai_fast.telemetry.record import load_record

if TYPE_CHECKING:  # matplotlib is the [plots] extra, imported where a figure is drawn
    from matplotlib.figure import Figure

__all__ = [
    "LAB_NETWORK",
    "LAB_SIZES",
    "LabRun",
    "PredictionImages",
    "lab_data",
    "performance",
    "performance_table",
    "prediction_figure",
    "run_lab",
]

#: the lab's network: SegResNet(init_filters=16, dropout_prob=0.2), four levels as MONAI's default
LAB_NETWORK = {"network": "segresnet", "channels": (16, 32, 64, 128), "strides": (2, 2, 2), "dropout": 0.2}

#: size name -> (synthetic cases, volume shape, recipe options): a smoke test, a CPU's, spleen-scale on a GPU
LAB_SIZES: dict[str, tuple[int, tuple[int, int, int], dict[str, Any]]] = {
    "tiny": (5, (48, 48, 32), {"patch_size": (32, 32, 32), "num_samples": 2, "cache_threads": 1, "max_epochs": 2}),
    "cpu": (16, (128, 128, 64), {"patch_size": (64, 64, 64), "max_epochs": 20}),
    "gpu": (40, (240, 240, 96), {"patch_size": (96, 96, 96), "max_epochs": 100}),
}


def _mask(t: torch.Tensor) -> np.ndarray:
    """A one-hot (or single-channel) segmentation as one channel of class indices, float32 on the CPU."""
    t = t.detach().float().cpu()
    return (t.argmax(0, keepdim=True) if t.shape[0] > 1 else t).numpy()


class PredictionImages:
    """At every validation: the first case's input, label and prediction to TensorBoard; the last kept for the figure.

    Args:
        writer: a TensorBoard ``SummaryWriter`` (images under ``lab/input``, ``lab/label``, ``lab/prediction``).
        trainer: the trainer whose epoch numbers the images' steps.
    """

    def __init__(self, writer: Any, trainer: Engine) -> None:
        if not hasattr(writer, "add_video") and not hasattr(writer, "add_image"):
            raise TypeError(f"writer: a TensorBoard SummaryWriter, got {type(writer).__name__}")
        self.writer = writer
        self.trainer = trainer
        self.last: dict[str, np.ndarray] = {}

    def attach(self, evaluator: Engine) -> None:
        """Write the images after the evaluator's first iteration of each run."""
        if not evaluator.has_event_handler(self, Events.ITERATION_COMPLETED):
            evaluator.add_event_handler(Events.ITERATION_COMPLETED(once=1), self)

    def __call__(self, engine: Engine) -> None:
        image, label, pred = (x[0] for x in from_engine(["image", "label", "pred"])(engine.state.output))
        self.last = {"input": image.detach().float().cpu().numpy(), "label": _mask(label), "prediction": _mask(pred)}
        for tag, volume in self.last.items():
            # axial frames (the last axis), as a radiologist scrolls
            plot_2d_or_3d_image(volume[None], self.trainer.state.epoch, self.writer, frame_dim=-1, tag=f"lab/{tag}")
        self.writer.flush()


def prediction_figure(volumes: dict[str, np.ndarray]) -> Figure:
    """Input, ground truth and prediction side by side on the axial slice with the most labelled voxels.

    A ``matplotlib.figure.Figure`` built without pyplot: a notebook shows it with ``display``, a script saves it."""
    if not volumes:
        raise ValueError("no validation images to draw: the evaluator has not run (PredictionImages saw nothing)")
    image, label, pred = volumes["input"][0], volumes["label"][0], volumes["prediction"][0]
    z = int(np.argmax(label.sum(axis=(0, 1)) if label.any() else pred.sum(axis=(0, 1))))
    figure = require("matplotlib.figure", extra="plots", feature="the lab's prediction figure")
    fig = figure.Figure(figsize=(10, 3.8), dpi=100)
    axes = fig.subplots(1, 3)
    for ax, (title, overlay) in zip(axes, (("input", None), ("ground truth", label), ("prediction", pred))):
        ax.imshow(np.rot90(image[:, :, z]), cmap="gray")
        if overlay is not None:
            ax.imshow(np.rot90(np.ma.masked_equal(overlay[:, :, z], 0)), cmap="autumn", alpha=0.6, vmin=0, vmax=1)
        ax.set_title(f"{title} (slice {z})")
        ax.axis("off")
    fig.tight_layout()
    return fig


def performance(
    result: TrainResult, peak_bytes: int, device: torch.device, summary: dict, network: torch.nn.Module
) -> dict:
    """The lab's expected-performance numbers, from the run's own measurements."""
    dice = [e.val_dice for e in result.epochs if e.val_dice is not None]
    gpus = [g for g in summary.get("gpu", {}).values() if isinstance(g, dict)]
    utils = [g["gpu_util_mean"] for g in gpus if g.get("gpu_util_mean") is not None]
    return {
        "device": result.device,
        "network": f"{type(network).__name__}, {sum(p.numel() for p in network.parameters()) / 1e6:.2f} M parameters",
        "epochs": result.epochs_run,
        "time_per_epoch_s": result.train_s_per_epoch + result.val_s_per_epoch,
        "train_s_per_epoch": result.train_s_per_epoch,
        "val_s_per_epoch": result.val_s_per_epoch,
        "samples_per_s": summary.get("throughput", {}).get("samples_per_s_mean"),
        "final_dice": dice[-1] if dice else None,
        "best_dice": result.best_dice,
        "peak_memory_mib": peak_bytes / 2**20,
        "peak_memory_kind": "peak GPU memory (reserved)" if device.type == "cuda" else "peak RSS (CPU)",
        "gpu_util_mean": sum(utils) / len(utils) if utils else None,
    }


def performance_table(p: dict) -> str:
    """``p`` (from `performance()`) as the lab's markdown table."""
    num = lambda v, fmt: "n/a" if v is None else format(v, fmt)
    rows = [
        ("device", p["device"]),
        ("network", p["network"]),
        ("epochs", str(p["epochs"])),
        (
            "time per epoch",
            f"{p['time_per_epoch_s']:.2f} s (train {p['train_s_per_epoch']:.2f} s + validation "
            f"{p['val_s_per_epoch']:.2f} s)",
        ),
        ("training throughput", "n/a" if p["samples_per_s"] is None else f"{p['samples_per_s']:.2f} patches/s"),
        ("final validation Dice", num(p["final_dice"], ".3f") + f" (best {num(p['best_dice'], '.3f')})"),
        (p["peak_memory_kind"], f"{p['peak_memory_mib']:.0f} MiB"),
        ("GPU utilisation", "n/a (no GPU)" if p["gpu_util_mean"] is None else f"{p['gpu_util_mean']:.0f} % (mean)"),
    ]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]) + "\n"


def _require_plots() -> None:
    for module in ("matplotlib", "tensorboard"):
        require(module, extra="plots", feature="the lab (its TensorBoard images and prediction figure)")


def lab_data(
    size: str, data_dir: str | os.PathLike | None = None, max_epochs: int | None = None, progress: bool = False
) -> tuple[list[dict], list[dict], RecipeConfig]:
    """The lab's files and recipe options at ``size`` (a key of `LAB_SIZES`), validating every epoch.

    Without ``data_dir`` a synthetic spleen-like set is written once into the cache; with it, that MSD
    folder is read (a quarter held out for validation)."""
    _require_plots()  # the lab's first step: before any data are written
    if size not in LAB_SIZES:
        raise ValueError(f"size={size!r}: one of {sorted(LAB_SIZES)}")
    if max_epochs is not None and max_epochs < 1:
        raise ValueError(f"max_epochs={max_epochs}: at least 1")
    cases, shape, options = LAB_SIZES[size]
    options = {**options, **({"max_epochs": max_epochs} if max_epochs is not None else {})}
    root = data_dir or synthetic_dataset("spleen-like", cases, shape, seed=0, progress=progress)
    train_files, val_files = load_msd_datalist(root, val_fraction=0.25)
    return train_files, val_files, RecipeConfig(**LAB_NETWORK, **options, validation="every_epoch")


@dataclass
class LabRun:
    """What one lab run measured and wrote."""

    result: TrainResult
    numbers: dict  #: `performance()`'s numbers (also in ``performance.json``)
    table: str  #: `performance_table()` (also in ``performance.md``)
    images: dict[str, np.ndarray]  #: the last validation's first case: ``input``, ``label``, ``prediction``
    run_dir: Path  #: TensorBoard events and the run record under ``<run_dir>/<recipe>``, the figure and table beside it
    record_dir: Path


def run_lab(
    train_files: list[dict],
    val_files: list[dict],
    config: RecipeConfig,
    device: str | torch.device,
    run_dir: str | os.PathLike,
    recipe: str = "fast",
    target: float = 1.0,
    progress: bool = False,
) -> LabRun:
    """Train ``recipe`` with ``config`` (e.g. from `lab_data()`) and write the lab's outputs into ``run_dir``.

    TensorBoard events and the run record (``<run_dir>/<recipe>/``), ``prediction.png``,
    ``performance.json`` and ``performance.md``; ``target`` stops at that Dice (1.0: every epoch runs).

    Example:
        >>> lab = run_lab(*lab_data("cpu"), "cpu", "runs/lab")  # doctest: +SKIP
    """
    _require_plots()
    device = torch.device(device)
    run_dir = Path(run_dir)
    with DeviceMemory(device).peak() as peak:
        run = TargetRun(recipe, train_files, val_files, config, device, target, None, run_dir, progress)
        images = PredictionImages(run.writer, run.built.trainer)
        images.attach(run.built.evaluator)
        run.segment(epochs=None)
        result = run.finish()

    out = run_dir / recipe
    fig = prediction_figure(images.last)
    with atomic_write(run_dir / "prediction.png", "wb") as f:
        fig.savefig(f, format="png", bbox_inches="tight")
    network = getattr(run.built.network, "module", run.built.network)
    numbers = performance(result, peak.peak_bytes, device, load_record(out)[1], network)
    write_json(numbers, run_dir / "performance.json")
    table = performance_table(numbers)
    write_text(
        f"# SegResNet lab: expected performance\n\nMeasured by this run on {device_description(device)}.\n\n{table}",
        run_dir / "performance.md",
    )
    return LabRun(result, numbers, table, images.last, run_dir, out)
