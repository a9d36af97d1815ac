"""Lab: a SegResNet on one GPU (or a CPU), watched in TensorBoard, its performance table measured by the run.

MONAI's ``SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=16, dropout_prob=0.2)``
learns the spleen-like synthetic set (or your MSD folder) in monai-fast's ``fast`` recipe: a MONAI
``SupervisedTrainer`` + ``SupervisedEvaluator`` with ``FastTraining`` (cache, precision, layout) and
the telemetry handlers (``TimeBreakdown``, ``ThroughputMonitor``, ``RecordHandler``, ``GPUSampler``
on a GPU). The run folder then holds:

* TensorBoard events (``<run-dir>/<recipe>/``): loss per iteration and epoch, validation Dice,
  samples/s, data-wait share, GPU utilisation and memory when there is a GPU, and at every
  validation the first case's input, label and prediction as 3D image summaries (animated along
  the axial axis, MONAI's ``plot_2d_or_3d_image``);
* ``prediction.png``: input, ground truth and prediction on the axial slice with the most spleen;
* ``performance.md`` and ``performance.json``: the lab's expected-performance table, measured:
  time per epoch, final and best Dice, peak GPU memory (peak RSS on a CPU), GPU utilisation;
* the run record and the doctor's ``report.md`` (``monai-fast doctor <run-dir>/<recipe>``).

    python tutorials/segresnet_lab.py                          # spleen-scale on a GPU, small on a CPU
    python tutorials/segresnet_lab.py --data-dir /data/Task09_Spleen --max-epochs 300
    python tutorials/segresnet_lab.py --tiny                   # seconds on a CPU: a smoke test
    tensorboard --logdir runs/segresnet-lab
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from ignite.engine import Engine, Events  # noqa: E402
from monai.handlers import from_engine  # noqa: E402
from monai.visualize import plot_2d_or_3d_image  # noqa: E402

from monai_fast.data.msd import load_msd_datalist  # noqa: E402
from monai_fast.data.synthetic import synthetic_dataset  # noqa: E402
from monai_fast.files import atomic_write, write_json, write_text  # noqa: E402
from monai_fast.recipes import RECIPES, RecipeConfig  # noqa: E402
from monai_fast.recipes.runner import RaceResult, TargetRun  # noqa: E402
from monai_fast.report.doctor import doctor  # noqa: E402
from monai_fast.telemetry import cuda_available, device_description  # noqa: E402
from monai_fast.telemetry.memory import DeviceMemory  # noqa: E402
from monai_fast.telemetry.record import load_record  # noqa: E402

logger = logging.getLogger("segresnet_lab")

#: the lab's network: SegResNet(init_filters=16, dropout_prob=0.2), four levels as MONAI's default
LAB_NETWORK = {"network": "segresnet", "channels": (16, 32, 64, 128), "strides": (2, 2, 2), "dropout": 0.2}


def _mask(t: torch.Tensor) -> np.ndarray:
    """A one-hot (or single-channel) segmentation as one channel of class indices, float32 on the CPU."""
    t = t.detach().float().cpu()
    return (t.argmax(0, keepdim=True) if t.shape[0] > 1 else t).numpy()


class PredictionImages:
    """At every validation: the first case's input, label and prediction to TensorBoard; the last kept for the figure.

    Example:
        >>> images = PredictionImages(writer, trainer)  # doctest: +SKIP
        >>> images.attach(evaluator)  # doctest: +SKIP
    """

    def __init__(self, writer, trainer: Engine) -> None:
        self.writer = writer
        self.trainer = trainer
        self.last: dict[str, np.ndarray] = {}

    def attach(self, evaluator: Engine) -> None:
        evaluator.add_event_handler(Events.ITERATION_COMPLETED(once=1), self)

    def __call__(self, engine: Engine) -> None:
        image, label, pred = (x[0] for x in from_engine(["image", "label", "pred"])(engine.state.output))
        self.last = {"input": image.detach().float().cpu().numpy(), "label": _mask(label), "prediction": _mask(pred)}
        for tag, volume in self.last.items():
            # axial frames (the last axis), as a radiologist scrolls
            plot_2d_or_3d_image(volume[None], self.trainer.state.epoch, self.writer, frame_dim=-1, tag=f"lab/{tag}")
        self.writer.flush()


def save_figure(volumes: dict[str, np.ndarray], path: Path) -> Path:
    """Input, ground truth and prediction side by side on the axial slice with the most labelled voxels."""
    image, label, pred = volumes["input"][0], volumes["label"][0], volumes["prediction"][0]
    z = int(np.argmax(label.sum(axis=(0, 1)) if label.any() else pred.sum(axis=(0, 1))))
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.8), dpi=100)
    for ax, (title, overlay) in zip(axes, (("input", None), ("ground truth", label), ("prediction", pred))):
        ax.imshow(np.rot90(image[:, :, z]), cmap="gray")
        if overlay is not None:
            ax.imshow(np.rot90(np.ma.masked_equal(overlay[:, :, z], 0)), cmap="autumn", alpha=0.6, vmin=0, vmax=1)
        ax.set_title(f"{title} (slice {z})")
        ax.axis("off")
    fig.tight_layout()
    try:
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def performance(result: RaceResult, peak_bytes: int, device: torch.device, summary: dict, network: torch.nn.Module) -> dict:
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
    """``p`` (from :func:`performance`) as the lab's markdown table."""
    def num(v: float | None, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    rows = [
        ("device", p["device"]),
        ("network", p["network"]),
        ("epochs", str(p["epochs"])),
        ("time per epoch", f"{p['time_per_epoch_s']:.2f} s (train {p['train_s_per_epoch']:.2f} s + validation "
                           f"{p['val_s_per_epoch']:.2f} s)"),
        ("training throughput", "n/a" if p["samples_per_s"] is None else f"{p['samples_per_s']:.2f} patches/s"),
        ("final validation Dice", num(p["final_dice"], ".3f") + f" (best {num(p['best_dice'], '.3f')})"),
        (p["peak_memory_kind"], f"{p['peak_memory_mib']:.0f} MiB"),
        ("GPU utilisation", "n/a (no GPU)" if p["gpu_util_mean"] is None else f"{p['gpu_util_mean']:.0f} % (mean)"),
    ]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]) + "\n"


def _options() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", help="MSD folder with dataset.json; default: a synthetic spleen-like set (cached)")
    p.add_argument("--device", default="cuda" if cuda_available() else "cpu")
    p.add_argument("--recipe", choices=RECIPES, default="fast", help="the recipe around the network (default %(default)s)")
    p.add_argument("--max-epochs", type=int, help="default 100 on a GPU, 20 on a CPU, 2 with --tiny")
    p.add_argument("--target", type=float, default=1.0, help="stop at this validation Dice (default: run every epoch)")
    p.add_argument("--run-dir", help="default runs/segresnet-lab-<time>")
    p.add_argument("--tiny", action="store_true", help="tiny data, 2 epochs: a smoke test in seconds on a CPU")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (one log line per epoch)")
    return p.parse_args()


def _data_and_config(args: argparse.Namespace, device: torch.device) -> tuple[list[dict], list[dict], RecipeConfig]:
    """The files and the recipe options at the lab's size: tiny, a CPU's, or spleen-scale on a GPU."""
    if args.tiny:
        cases, shape, size = 5, (48, 48, 32), {"patch_size": (32, 32, 32), "num_samples": 2, "cache_workers": 1, "max_epochs": 2}
    elif device.type == "cuda":
        cases, shape, size = 40, (240, 240, 96), {"patch_size": (96, 96, 96), "max_epochs": 100}
    else:
        cases, shape, size = 16, (128, 128, 64), {"patch_size": (64, 64, 64), "max_epochs": 20}
    if args.max_epochs is not None:
        size["max_epochs"] = args.max_epochs
    root = args.data_dir or synthetic_dataset("spleen-like", cases, shape, seed=0, progress=not args.no_progress)
    train_files, val_files = load_msd_datalist(root, val_fraction=0.25)
    return train_files, val_files, RecipeConfig(**LAB_NETWORK, **size, validation="every_epoch")  # the lab shows Dice every epoch


def main() -> None:
    args = _options()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ignite").setLevel(logging.WARNING)
    device = torch.device(args.device)
    run_dir = Path(args.run_dir or f"runs/segresnet-lab-{dt.datetime.now():%Y%m%d-%H%M%S}")
    train_files, val_files, config = _data_and_config(args, device)

    with DeviceMemory(device).peak() as peak:
        run = TargetRun(args.recipe, train_files, val_files, config, device, target=args.target, time_budget_s=None,
                        run_dir=run_dir, progress=not args.no_progress)
        images = PredictionImages(run.writer, run.built.trainer)
        images.attach(run.built.evaluator)
        run.segment(epochs=None)
        result = run.finish()

    out = run_dir / args.recipe
    figure = save_figure(images.last, run_dir / "prediction.png")
    network = getattr(run.built.network, "module", run.built.network)
    numbers = performance(result, peak.peak_bytes, device, load_record(out)[1], network)
    write_json(numbers, run_dir / "performance.json")
    table = performance_table(numbers)
    write_text(f"# SegResNet lab: expected performance\n\nMeasured by this run on {device_description(device)}.\n\n{table}",
               run_dir / "performance.md")
    diagnosis = doctor(out)
    print(table)
    print(f"doctor: {diagnosis.verdict}; figure: {figure}; table: {run_dir / 'performance.md'}")
    print(f"tensorboard --logdir {run_dir}")


if __name__ == "__main__":
    main()
