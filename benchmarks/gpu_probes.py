"""The GPU suite's own probes, each run as a process by ``gpu_suite.py``, and the reading of every step's results.

Probes: ``data`` (the spleen-scale synthetic set: 40 volumes of 512x512x90 at 0.8x0.8x2.5 mm, as
Task09_Spleen after loading; ``--tiny``: 6 of 64x64x24), ``kernels`` (``summarise_profile`` of a
UNet's training steps against ``torch.profiler``'s own ``key_averages`` totals: device time on
CUDA, CPU time on a CPU) and ``nvtx`` (``NVTXHandler`` ranges under ``nsys`` when a binary is
found, else recorded as not checked). Each writes ``<out>/<probe>.json``.

    python benchmarks/gpu_probes.py kernels --device cuda --out /tmp/suite --work /tmp/suite/work
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata as md
import json
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from monai_fast.files import write_json

ROOT = Path(__file__).resolve().parent.parent


SPLEEN_SCALE = {"num_cases": 40, "shape": (512, 512, 90), "spacing": (0.8, 0.8, 2.5)}
TINY_SET = {"num_cases": 6, "shape": (64, 64, 24), "spacing": (0.8, 0.8, 2.5)}
NSYS_GLOBS = ("/opt/nvidia/nsight-systems*/*/bin/nsys", "/usr/local/cuda*/bin/nsys", "/opt/nvidia/*/*/host/*/nsys")


def _run(argv: list[str], timeout: float = 30.0) -> str | None:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, check=True, cwd=ROOT
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def machine(device: str, commit: str | None, root: Path) -> dict:
    """The device, driver, library versions and source commit (``commit`` wins over ``git rev-parse``)."""
    import torch

    from monai_fast.telemetry import device_description

    head = _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"]) if head else None
    versions = {}
    for dist in ("monai", "pytorch-ignite", "nibabel", "nvtx", "nvidia-ml-py", "numpy", "tqdm", "tensorboard"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "device": device,
        "description": device_description(device),
        "driver": driver.splitlines()[0] if driver else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": versions,
        "commit": commit or head,
        "commit_from": "--commit" if commit else ("git" if head else None),
        "tree_changed": None if commit or not head else bool(dirty),
    }


def probe_data(args: argparse.Namespace) -> dict:
    """Write the race's set into ``<work>/spleen_scale`` (reused when already complete for these sizes)."""
    from monai_fast.apps.sources.synthetic import generate_msd

    spec = TINY_SET if args.tiny else SPLEEN_SCALE
    root = Path(args.work) / "spleen_scale"
    ready = root / "dataset.json"
    meta = json.loads(ready.read_text()).get("monai_fast", {}) if ready.is_file() else {}
    if meta.get("shape") != list(spec["shape"]) or meta.get("spacing") != list(spec["spacing"]):
        generate_msd(root, "spleen-like", progress=False, **spec)
    return {"root": str(root), **{k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()}}


def probe_kernels(args: argparse.Namespace) -> dict:
    """Three training steps of MONAI's UNet under ``torch.profiler``; the summary's totals against torch's own."""
    import torch
    from monai.networks.nets import UNet
    from torch.profiler import ProfilerActivity, profile

    from monai_fast.handlers.profiling import summarise_profile

    dev = torch.device(args.device)
    channels, patch, batch = ((4, 8, 16), 32, 1) if args.tiny else ((16, 32, 64, 128, 256), 96, 2)
    net = UNet(3, 1, 2, channels=channels, strides=(2,) * (len(channels) - 1), num_res_units=2).to(dev)
    opt = torch.optim.AdamW(net.parameters())
    x = torch.randn(batch, 1, patch, patch, patch, device=dev)
    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(3):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = net(x).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(dev)
    averages = prof.key_averages()
    summary = summarise_profile(averages)
    kernel_rows = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    if cuda:
        torch_ns = sum(e.self_device_time_total for e in kernel_rows) * 1000
        ours_ns = summary["All kernels"]["GPU Time (ns)"]
    else:
        torch_ns = sum(e.self_cpu_time_total for e in averages) * 1000
        ours_ns = summary["All kernels"]["CPU Time (ns)"]
    rows = len(averages)  # each row's time is truncated to whole ns in the summary
    match = abs(ours_ns - torch_ns) <= max(rows, 1e-6 * torch_ns) and (
        summary["All kernels"]["# Kernels"] > 0 or not cuda
    )
    return {
        "compared": "GPU Time (ns)" if cuda else "CPU Time (ns)",
        "summary_ns": ours_ns,
        "torch_ns": torch_ns,
        "match": bool(match),
        "kernels": summary["All kernels"],
        "ranked_by": summary["ranked_by"],
        "top": summary["top"][:5],
        "ok": bool(match),
    }


def nvtx_workload(args: argparse.Namespace) -> dict:
    """A real ignite engine with ``NVTXHandler`` on a few matrix products on the device."""
    import torch
    from ignite.engine import Engine

    from monai_fast.handlers import NVTXHandler

    dev = torch.device(args.device)
    a = torch.randn(256, 256, device=dev)
    engine = Engine(lambda e, b: (a @ a).sum().item())
    handler = NVTXHandler(label="suite")
    handler.attach(engine)
    engine.run(list(range(4)), max_epochs=2)
    return {"backend": type(handler.backend).__name__, "iterations": engine.state.iteration}


def find_nsys() -> str | None:
    found = shutil.which("nsys")
    if found:
        return found
    hits = sorted(h for g in NSYS_GLOBS for h in glob.glob(g))
    return hits[-1] if hits else None


def probe_nvtx(args: argparse.Namespace) -> dict:
    """The workload's ranges under ``nsys`` (``nsys stats`` must list ``suite: iteration``); without nsys, say so."""
    nsys = find_nsys()
    if nsys is None:
        return {
            "nsys": None,
            "checked": False,
            "workload": nvtx_workload(args),
            "ok": True,
            "note": "no nsys binary on PATH or under /opt/nvidia, /usr/local/cuda: ranges not checked",
        }
    rep = Path(args.work) / "nvtx_probe"
    me = [
        sys.executable,
        str(Path(__file__).resolve()),
        "nvtx_workload",
        "--device",
        args.device,
        "--out",
        str(Path(args.work)),
        "--work",
        str(args.work),
    ]
    prof = _run([nsys, "profile", "--trace=nvtx,cuda", "--force-overwrite=true", "-o", str(rep), *me], timeout=240)
    stats = None
    for report in ("nvtx_sum", "nvtxsum", "nvtx_pushpop_sum"):
        stats = _run([nsys, "stats", "--report", report, "--format", "csv", str(rep) + ".nsys-rep"], timeout=120)
        if stats:
            break
    seen = bool(stats) and "suite: iteration" in stats
    return {
        "nsys": nsys,
        "checked": True,
        "profiled": prof is not None,
        "ranges_seen": seen,
        "stats_excerpt": (stats or "")[:2000],
        "ok": seen,
    }


PROBES = {"data": probe_data, "kernels": probe_kernels, "nvtx": probe_nvtx, "nvtx_workload": nvtx_workload}


def _newest_json(folder: Path) -> dict:
    files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no results JSON in {folder}")
    return {"file": str(files[-1].name), **json.loads(files[-1].read_text())}


def collect_pytest(out: Path) -> dict:
    """Counts and the failed tests' names from ``pytest_gpu.xml``."""
    suites = ET.parse(out / "pytest_gpu.xml").getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for s in suites
        for c in s
        if c.find("failure") is not None or c.find("error") is not None
    ]
    return {
        **counts,
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed_tests": failed,
    }


def collect_race(out: Path, work: Path) -> dict:
    """Per repeat and recipe: time to the target, GPUSampler's readings and data wait; the GPU bars (speed-up,
    utilisation)."""
    doc = _newest_json(out / "race")
    runs = []
    for i, repeat in enumerate(doc["repeats"], 1):
        for r in repeat:
            numbers = (r.get("diagnosis") or {}).get("numbers", {})
            runs.append(
                {
                    "repeat": i,
                    "recipe": r["recipe"],
                    "reached": r["reached"],
                    "time_to_target_s": r["time_to_target_s"],
                    "total_s": r["total_s"],
                    "epochs_run": r["epochs_run"],
                    "best_dice": r["best_dice"],
                    "data_wait_share": r["data_wait_share"],
                    "gpu_util_mean": numbers.get("gpu_util_mean"),
                    "gpu_mem_peak_fraction": numbers.get("gpu_mem_peak_fraction"),
                    "gpu_samples": numbers.get("gpu_samples", 0),
                }
            )
            csv = work / "race_runs" / f"repeat{i}" / r["recipe"] / "gpu_rank0.csv"
            if csv.is_file():
                shutil.copyfile(csv, out / "race" / f"gpu_repeat{i}_{r['recipe']}.csv")
    fast = [r for r in runs if r["recipe"] == "fast"]
    speedups = doc["summary"].get("fast", {})
    bars = {
        "fast_2x_monai_tutorial": [
            s["factor"] is not None and s["factor"] >= 2 for s in speedups.get("speedup_over_monai_tutorial", [])
        ],
        "fast_20x_baseline": [
            s["factor"] is not None and s["factor"] >= 20 for s in speedups.get("speedup_over_baseline", [])
        ],
        "fast_gpu_util_90": [r["gpu_util_mean"] is not None and r["gpu_util_mean"] >= 90 for r in fast],
        "fast_data_wait_under_2pct": [r["data_wait_share"] < 0.02 for r in fast],
    }
    return {"file": doc["file"], "runs": runs, "summary": doc["summary"], "bars": bars}


def collect(name: str, out: Path, work: Path, device: str) -> dict | None:
    """What step ``name`` measured, read from the files it wrote under ``out``."""
    if name == "pytest":
        return collect_pytest(out)
    if name == "race":
        return collect_race(out, work)
    if name == "overlaps":
        doc = _newest_json(out / name)
        rows = doc["summary"]
        on, off = rows.get("on", {}), rows.get("off", {})
        bars = {  # the overlaps' two ratios on a GPU, utilisation not lower with the overlaps
            "on_first_within_1_5x_training": on.get("first_over_train") is not None and on["first_over_train"] <= 1.5,
            "on_1_8x_faster_than_off": [r >= 1.8 for r in on.get("off_over_this_first", [])],
            "gpu_util_not_lower": None
            if on.get("gpu_util_training") is None or off.get("gpu_util_training") is None
            else on["gpu_util_training"] >= off["gpu_util_training"],
        }
        return {"file": doc["file"], "summary": rows, "bars": bars}
    if name in ("your_trainer", "tuner_quality", "loader_variants"):
        doc = _newest_json(out / name)
        if name == "your_trainer":
            return {
                "file": doc["file"],
                "median_epoch_ratio": doc["median_epoch_ratio"],
                "applied": doc["applied"],
                "rows": doc["rows"],
            }
        if name == "tuner_quality":
            oom = [
                t for r in doc["tuner_runs"] for t in r["tuner"].get("trials", []) if t.get("reason") == "out of memory"
            ]
            return {
                "file": doc["file"],
                "precision": doc["precision"],
                "cuda_oom_trials": len(oom),
                "picks": [
                    {k: r[k] for k in ("batch_size", "sw_batch_size", "val_device", "h2h_pick_over_best", "tuning_s")}
                    for r in doc["tuner_runs"]
                ],
            }
        return {
            "file": doc["file"],
            "rows": doc["rows"],
            "gpu_cache": any(r["variant"] == "gpu_cache" for r in doc["rows"]),
        }
    if name == "inference":
        doc = _newest_json(out / name)
        return {"file": doc["file"], "rows": doc["rows"]}
    if name == "pathology":
        doc = _newest_json(out / name)
        return {
            "file": doc["file"],
            "runs": [{k: v for k, v in r.items() if k not in ("history", "config")} for r in doc["runs"]],
        }
    if name == "lab":  # its table, figure and numbers; the TensorBoard events stay in the scratch folder
        (out / "lab").mkdir(parents=True, exist_ok=True)
        for f in ("performance.json", "performance.md", "prediction.png"):
            shutil.copyfile(work / "lab" / f, out / "lab" / f)
        return json.loads((out / "lab" / "performance.json").read_text())
    return json.loads((out / f"{name}.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("probe", choices=sorted(PROBES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", required=True, help="folder of <probe>.json")
    p.add_argument("--work", required=True, help="scratch folder")
    args = p.parse_args(argv)
    result = PROBES[args.probe](args)
    print(json.dumps(result, indent=1, default=str)[:4000])
    if args.probe != "nvtx_workload":
        write_json(result, Path(args.out) / f"{args.probe}.json")
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
