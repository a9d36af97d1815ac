"""A run's results files: ``results.json``, all results' epochs in ``epochs.csv``, and ``dice_vs_time.png``."""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from monai_fast.apps.training.run import TrainResult, write_epochs_csv
from monai_fast.extras import available, require
from monai_fast.files import atomic_write, write_json

__all__ = ["plot_dice_vs_time", "run_meta", "write_results"]

logger = logging.getLogger("monai_fast.report")


def run_meta(data_root: Path | str | None, device: str, options: Mapping[str, Any] | None = None) -> dict:
    """The date, machine, package versions, data and options that a results file records."""
    import ignite
    import monai
    import torch

    from monai_fast import __version__
    from monai_fast.telemetry import device_description

    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "device": device_description(device),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": {"monai_fast": __version__, **{m.__name__: m.__version__ for m in (torch, monai, ignite)}},
        "data": None if data_root is None else str(data_root),
        "command": " ".join(sys.argv),
        "options": dict(options or {}),
    }


def plot_dice_vs_time(results: Sequence[TrainResult], path: str | os.PathLike, target: float | None = None) -> Path:
    """PNG of validation Dice against wall-clock seconds (caching included), one line per recipe, drawn without
    pyplot (the caller's matplotlib backend stays as it is)."""
    figure = require("matplotlib.figure", extra="plots", feature="the Dice-vs-time PNG of a race")
    fig = figure.Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.subplots()
    for r in results:
        pts = [(e.elapsed_s, e.val_dice) for e in r.epochs if e.val_dice is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=3, label=r.recipe)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("seconds on each recipe's own clock (its set-up and cache filling included)")
    ax.set_ylabel("validation mean Dice")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    ax.set_title("Time to Dice")
    fig.tight_layout()
    path = Path(path)
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png")
    return path


def write_results(
    results: Sequence[TrainResult],
    run_dir: str | os.PathLike,
    meta: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
) -> dict:
    """Write ``results.json``, ``epochs.csv`` (all results) and ``dice_vs_time.png`` (with the plots extra) into
    ``run_dir`` (created).

    Each file is tried on its own: one that cannot be written (a full disk) is logged with its path,
    the others are still written, and the first failure is raised at the end. ``results.json`` holds
    ``meta`` (`run_meta()`), the results, then ``extra`` (a race's speed-ups); that dict is returned.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    doc = {**meta, "results": [r.to_dict() for r in results], **(extra or {})}
    target = results[0].target if results else None
    writes = [
        (run_dir / "results.json", lambda path: write_json(doc, path)),
        (run_dir / "epochs.csv", lambda path: write_epochs_csv((e for r in results for e in r.epochs), path)),
    ]
    if available("matplotlib"):  # a by-product of the run, like its TensorBoard events: skipped without the extra
        writes.append((run_dir / "dice_vs_time.png", lambda path: plot_dice_vs_time(results, path, target)))
    else:
        logger.warning(
            'not written: %s: it needs matplotlib: pip install "monai-fast[plots]"', run_dir / "dice_vs_time.png"
        )
    failed: list[OSError] = []
    for path, write in writes:  # each output on its own: one that does not fit costs only itself
        try:
            write(path)
        except OSError as err:
            logger.error("not written: %s: %s", path, err)
            failed.append(err)
    if failed:
        raise failed[0]
    return doc
