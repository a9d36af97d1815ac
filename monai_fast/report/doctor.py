"""``monai-fast doctor``: name a run's bottleneck from its record alone, with the evidence and the fix.

The doctor reads only the run record (``record.rank*.jsonl`` + ``summary.rank*.json``, written by
the handlers), never the live process, so a record made on a GPU cluster can be diagnosed later
on a laptop. Verdicts:

* ``data-bound``: the loader makes the model wait (data share >= ``data_threshold``);
* ``gpu-under-filled``: the GPU idles with memory to spare (mean utilisation < ``util_low`` and
  peak memory < ``mem_low`` of the card) although data keeps up;
* ``compute-bound``: data wait is negligible (< ``data_low``) and the device is busy;
* ``balanced``: none of the above stands out.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from monai_fast.files import write_text  # noqa: E402
from monai_fast.telemetry.record import load_record  # noqa: E402

__all__ = ["Diagnosis", "diagnose", "doctor", "write_report"]

FIXES = {
    "data-bound": [
        "cache the deterministic transforms: recipe 'fast' (CacheDataset; on CUDA the cache sits in GPU "
        "memory via ToDeviced and the random transforms run there)",
        "once cached, load with ThreadDataLoader(num_workers=0): no worker processes, no IPC",
        "data larger than RAM: PersistentDataset (disk) or SmartCacheDataset (a rotating subset)",
        "precompute foreground/background indices (FgBgToIndicesd) so RandCropByPosNegLabeld skips the label scan",
    ],
    "gpu-under-filled": [
        "raise the batch size or crops per volume (RecipeConfig.batch_size / num_samples) until memory is used",
        "raise the sliding-window batch (RecipeConfig.sw_batch_size) for validation",
        "turn AMP on (recipe 'fast' does on CUDA) so larger batches fit",
    ],
    "compute-bound": [
        "mixed precision (AMP: bf16 where supported, else fp16 + GradScaler)",
        "channels_last_3d weights (recipe 'fast' uses them)",
        "more devices: data-parallel training over several GPUs",
        "validate less often or with a larger sliding-window batch (val_interval, sw_batch_size)",
    ],
    "balanced": [
        "no single bottleneck stands out; profile a window with KernelProfiler to find the costliest ops",
    ],
}


@dataclass
class Diagnosis:
    """The doctor's verdict with the numbers behind it."""

    verdict: str
    evidence: list[str]
    fixes: list[str]
    numbers: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        lines = [f"verdict: {self.verdict}", "evidence:"]
        lines += [f"  - {e}" for e in self.evidence]
        lines += ["what to change:"] + [f"  - {f}" for f in self.fixes]
        return "\n".join(lines)


def diagnose(
    rows: list[dict],
    data_threshold: float = 0.2,
    data_low: float = 0.05,
    util_low: float = 60.0,
    mem_low: float = 0.5,
) -> Diagnosis:
    """Decide the verdict from record rows (see the module docstring for the rules).

    Raises:
        ValueError: if the rows hold no ``time_breakdown`` epochs (attach ``TimeBreakdown``).
    """
    epochs = [r for r in rows if r.get("kind") == "epoch" and r.get("source") == "time_breakdown"]
    if not epochs:
        raise ValueError("the record has no time_breakdown epochs: attach TimeBreakdown (and RecordHandler) to the trainer")
    data = sum(r["data_s"] for r in epochs)
    busy = data + sum(r["compute_s"] for r in epochs)
    share = data / busy if busy else 0.0
    numbers: dict = {"epochs": len(epochs), "data_s": data, "compute_s": busy - data, "data_share": share}
    evidence = [
        f"{100 * share:.1f}% of iteration time was spent waiting for data "
        f"({data:.1f} s of {busy:.1f} s over {len(epochs)} epoch(s))"
    ]
    if len(epochs) > 1:
        later = epochs[1:]
        ld = sum(r["data_s"] for r in later)
        lb = ld + sum(r["compute_s"] for r in later)
        numbers["data_share_after_first_epoch"] = ld / lb if lb else 0.0
        evidence.append(f"after the first epoch: {100 * numbers['data_share_after_first_epoch']:.1f}%")

    gpu = [r for r in rows if r.get("kind") == "interval" and r.get("source") == "gpu"]
    util_mean = mem_peak = None
    if gpu:
        util_mean = sum(r["gpu_util"] for r in gpu) / len(gpu)
        mem_peak = max(r["mem_used_mib"] / r["mem_total_mib"] for r in gpu)
        numbers.update(gpu_util_mean=util_mean, gpu_mem_peak_fraction=mem_peak, gpu_samples=len(gpu))
        evidence.append(
            f"GPU utilisation averaged {util_mean:.0f}% over {len(gpu)} samples; peak memory {100 * mem_peak:.0f}% of the card"
        )
    else:
        evidence.append("no GPU samples in the record (CPU run, or GPUSampler not attached)")
    tp = [r for r in rows if r.get("kind") == "epoch" and r.get("source") == "throughput"]
    if tp:
        numbers["samples_per_s"] = sum(r["samples_per_s"] for r in tp) / len(tp)
        evidence.append(f"throughput {numbers['samples_per_s']:.2f} samples/s")

    if share >= data_threshold:
        verdict = "data-bound"
    elif util_mean is not None and util_mean < util_low and mem_peak is not None and mem_peak < mem_low:
        verdict = "gpu-under-filled"
    elif share < data_low and (util_mean is None or util_mean >= util_low):
        verdict = "compute-bound"
    else:
        verdict = "balanced"
    fixes = list(FIXES[verdict])
    if verdict == "compute-bound" and util_mean is None:
        fixes.insert(0, "this ran on the CPU: a CUDA GPU is the largest single step")
    numbers["thresholds"] = {"data_threshold": data_threshold, "data_low": data_low, "util_low": util_low, "mem_low": mem_low}
    return Diagnosis(verdict, evidence, fixes, numbers)


def _plot_breakdown(epochs: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    xs = [r["epoch"] for r in epochs]
    comp = [r["compute_s"] for r in epochs]
    data = [r["data_s"] for r in epochs]
    ax.bar(xs, comp, label="compute", color="tab:green")
    ax.bar(xs, data, bottom=comp, label="waiting for data", color="tab:red")
    ax.set_xlabel("epoch")
    ax.set_ylabel("seconds")
    ax.set_title("Time per epoch: compute vs data wait")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_gpu(gpu: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    for key in sorted({(r.get("rank", 0), r["gpu"]) for r in gpu}):
        pts = [r for r in gpu if (r.get("rank", 0), r["gpu"]) == key]
        ax.plot([r["t"] for r in pts], [r["gpu_util"] for r in pts], label=f"rank {key[0]} GPU {key[1]}")
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("GPU utilisation %")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(run_dir: str | os.PathLike, diagnosis: Diagnosis, rows: list[dict]) -> Path:
    """Write ``report.md`` with ``time_breakdown.png`` (and ``gpu_util.png`` with GPU samples)."""
    run_dir = Path(run_dir)
    epochs = [r for r in rows if r.get("kind") == "epoch" and r.get("source") == "time_breakdown"]
    gpu = [r for r in rows if r.get("kind") == "interval" and r.get("source") == "gpu"]
    _plot_breakdown(epochs, run_dir / "time_breakdown.png")
    md = [f"# monai-fast doctor: {run_dir.name}", "", f"**Verdict: {diagnosis.verdict}**", "", "## Evidence", ""]
    md += [f"- {e}" for e in diagnosis.evidence]
    md += ["", "## What to change", ""] + [f"- {f}" for f in diagnosis.fixes]
    md += ["", "## Time per epoch", "", "![time breakdown](time_breakdown.png)", ""]
    md += ["| epoch | iterations | data wait s | compute s | data share |", "|---|---|---|---|---|"]
    md += [f"| {r['epoch']} | {r['iterations']} | {r['data_s']:.2f} | {r['compute_s']:.2f} | {100 * r['data_share']:.1f}% |" for r in epochs]
    if gpu:
        _plot_gpu(gpu, run_dir / "gpu_util.png")
        md += ["", "## GPU utilisation", "", "![GPU utilisation](gpu_util.png)"]
    path = run_dir / "report.md"
    write_text("\n".join(md) + "\n", path)
    return path


def doctor(run_dir: str | os.PathLike, **thresholds: float) -> Diagnosis:
    """Load the record in ``run_dir``, diagnose it and write ``report.md``; returns the diagnosis."""
    rows, _ = load_record(run_dir)
    diagnosis = diagnose(rows, **thresholds)
    write_report(run_dir, diagnosis, rows)
    return diagnosis
