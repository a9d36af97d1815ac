"""The PNG plots of a run's record: time per epoch (compute vs data wait), the wall clock's shares, GPU utilisation.

matplotlib is the ``plots`` extra: without it each plot raises `MissingExtraError`; `pyplot_missing()` says so
without raising.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from monai_fast.extras import MissingExtraError, require
from monai_fast.files import atomic_write
from monai_fast.report.wall_clock import LABELS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["breakdown_figure", "plot_breakdown", "plot_gpu", "plot_wall_clock", "pyplot_missing"]

_COLOURS = {
    "setup": "tab:gray",
    "cache_fill": "tab:brown",
    "compute": "tab:green",
    "data_wait": "tab:red",
    "validation": "tab:blue",
    "checkpoint": "tab:purple",
    "paused": "lavender",
    "handlers": "tab:orange",
    "idle": "lightgray",
}

_agg = False  # the Agg backend is chosen once, by the first plot


def _pyplot(feature: str) -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, no window); `MissingExtraError` without it."""
    global _agg
    matplotlib = require("matplotlib", extra="plots", feature=feature)
    if not _agg:
        matplotlib.use("Agg")
        _agg = True
    return require("matplotlib.pyplot", extra="plots", feature=feature)


def pyplot_missing(feature: str) -> MissingExtraError | None:
    """The error a plot for ``feature`` would raise (matplotlib not installed), or ``None`` when plots can be drawn."""
    try:
        _pyplot(feature)
    except MissingExtraError as e:
        return e
    return None


def _save(plt: ModuleType, fig: Figure, path: str | os.PathLike) -> Path:
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_write(path, "wb") as f:  # a report never shows half a picture
            fig.savefig(f, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def breakdown_figure(epochs: list[dict]) -> Figure:
    """The figure `plot_breakdown()` saves: compute and data wait per epoch, a bar per rank, a later segment
    after a dashed line."""
    plt = _pyplot("drawing the time-per-epoch figure")
    ticker = require("matplotlib.ticker", extra="plots", feature="drawing the time-per-epoch figure")
    keys = sorted({(r.get("segment", 0), r["epoch"]) for r in epochs})
    ranks = sorted({int(r.get("rank", 0)) for r in epochs})
    width = 0.8 / len(ranks)
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    for i, rank in enumerate(ranks):
        mine = {(r.get("segment", 0), r["epoch"]): r for r in epochs if int(r.get("rank", 0)) == rank}
        xs = [k + (i - (len(ranks) - 1) / 2) * width for k, key in enumerate(keys) if key in mine]
        comp = [mine[key]["compute_s"] for key in keys if key in mine]
        data = [mine[key]["data_s"] for key in keys if key in mine]
        suffix, alpha = f" (rank {rank})" if len(ranks) > 1 else "", 1.0 - 0.5 * i / len(ranks)
        ax.bar(xs, comp, width=width, label=f"compute{suffix}", color="tab:green", alpha=alpha)
        ax.bar(xs, data, width=width, bottom=comp, label=f"waiting for data{suffix}", color="tab:red", alpha=alpha)
    for k, (segment, _) in enumerate(keys):
        if k and segment != keys[k - 1][0]:
            ax.axvline(k - 0.5, color="grey", linestyle="--", linewidth=1)
            ax.annotate(
                f"run {segment + 1}", (k - 0.4, 1.0), xycoords=("data", "axes fraction"), va="top", fontsize="small"
            )
    ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=12, integer=True))
    ax.xaxis.set_major_formatter(
        ticker.FuncFormatter(lambda x, _: str(keys[int(x)][1]) if 0 <= int(x) < len(keys) and x == int(x) else "")
    )
    ax.set_xlim(-0.6, len(keys) - 0.4)
    ax.set(xlabel="epoch", ylabel="seconds", title="Time per epoch: compute vs data wait")
    ax.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2 * min(len(ranks), 2), frameon=False, fontsize="small"
    )
    return fig


def plot_breakdown(epochs: list[dict], path: str | os.PathLike) -> Path:
    """Save `breakdown_figure()` of ``epochs`` as a PNG at ``path`` (written atomically)."""
    return _save(_pyplot(f"drawing {Path(path).name}"), breakdown_figure(epochs), path)


def plot_gpu(gpu: list[dict], path: str | os.PathLike) -> Path:
    """GPU utilisation over time, one line per rank and GPU."""
    plt = _pyplot(f"drawing {Path(path).name}")
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    for key in sorted({(r.get("rank", 0), r["gpu"]) for r in gpu}):
        pts = [r for r in gpu if (r.get("rank", 0), r["gpu"]) == key]
        ax.plot([r["t"] for r in pts], [r["gpu_util"] for r in pts], label=f"rank {key[0]} GPU {key[1]}")
    ax.set(ylim=(0, 105), xlabel="seconds since start", ylabel="GPU utilisation %")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_wall_clock(wc: dict, path: str | os.PathLike) -> Path:
    """One bar of the wall clock's critical path by category (``wc``: `WallClock.to_dict()`), one of the work that
    overlapped training."""
    plt = _pyplot(f"drawing {Path(path).name}")
    bars = [("wall clock", wc["seconds"])] + ([("overlapped", wc["overlapped"])] if wc["overlapped"] else [])
    fig, ax = plt.subplots(figsize=(6, 1.8 + 0.4 * len(bars)), dpi=100)
    for y, (_, parts) in enumerate(bars):
        left = 0.0
        for cat, seconds in parts.items():
            if seconds <= 0:
                continue
            share = f"{100 * wc['shares'][cat]:.0f}%" if y == 0 else f"{seconds:.1f} s beside training"
            label = f"{LABELS.get(cat, cat)} ({share})"
            ax.barh(y, seconds, left=left, color=_COLOURS.get(cat, "tab:cyan"), hatch="//" if y else None, label=label)
            left += seconds
    ax.set_yticks(range(len(bars)), [name for name, _ in bars])
    ax.invert_yaxis()
    ax.set(xlabel="seconds", title=f"Where the wall clock went (rank {wc['rank']}, {wc['total_s']:.1f} s)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize="small")
    return _save(plt, fig, path)
