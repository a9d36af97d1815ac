"""A SmartCache window in RAM (MONAI's way) against the same window over the crop-reading tier.

Both variants are `SafeSmartCacheDataset` over the same synthetic spleen-like volumes and MONAI's spleen-tutorial
chain (`your_trainer.py`'s, with ``RandCropByPosNegLabeld``), the same window (``--window`` items) and replacement
rate; ``tier`` adds ``cache_dir`` (a fresh folder, so its writes are in the run). Each epoch loads the window's
crops through a MONAI ``DataLoader`` (the data path alone, no network) and then waits for the window's rotation
(``update_cache``). The run covers the data set ``--cycles`` times; the first cycle computes (and, for the tier,
writes) every item, the later ones are what a long run sees. Variants take turns, repeat by repeat.

The table gives the bytes the window holds in RAM, the first cycle's seconds, and for the later cycles the
median loading seconds per epoch and the median wait for the rotation; the ratios are measured in the same
repeat.

    python benchmarks/smartcache_tier.py                  # about 3 minutes on 2 CPU cores
    python benchmarks/smartcache_tier.py --cases 24 --window 8 --cycles 3 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from monai.data import DataLoader, list_data_collate
from your_trainer import tutorial_chain

from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.data.smartcache import SafeSmartCacheDataset, window_bytes
from monai_fast.files import write_json
from monai_fast.telemetry import device_description

VARIANTS = ("ram", "tier")


def run_once(files: list[dict], args: argparse.Namespace, variant: str, folder: Path) -> dict:
    """One run of ``variant``: per epoch the loading seconds, the rotation's wait and the window's bytes."""
    t0 = time.perf_counter()
    ds = SafeSmartCacheDataset(
        files,
        tutorial_chain(tuple(args.patch), random=True),
        args.replace_rate,
        cache_num=args.window,
        num_replace_workers=1,
        shuffle=False,
        progress=False,
        cache_dir=folder if variant == "tier" else None,
    )
    ds.transform.set_random_state(seed=args.seed)
    built_s = time.perf_counter() - t0
    loader = DataLoader(ds, batch_size=2, num_workers=0, collate_fn=list_data_collate)
    epochs = []
    per_cycle = max(1, -(-len(files) // ds.replace_num))
    for epoch in range(args.cycles * per_cycle):
        t = time.perf_counter()
        crops = sum(len(batch["image"]) for batch in loader)
        load_s = time.perf_counter() - t
        t = time.perf_counter()
        ds.update_cache(timeout_s=600)
        wait_s = time.perf_counter() - t
        epochs.append(
            {
                "epoch": epoch + 1,
                "cycle": epoch // per_cycle + 1,
                "load_s": load_s,
                "rotation_wait_s": wait_s,
                "crops": crops,
                "window_ram_bytes": window_bytes(ds),
            }
        )
    ds.shutdown()
    return {"variant": variant, "built_s": built_s, "run_s": time.perf_counter() - t0, "epochs": epochs}


def summarise(run: dict) -> dict:
    """One table row: the window's RAM, the first cycle's seconds, the later cycles' medians."""
    first = [e for e in run["epochs"] if e["cycle"] == 1]
    later = [e for e in run["epochs"] if e["cycle"] > 1] or first
    return {
        "variant": run["variant"],
        "window_ram_mib": max(e["window_ram_bytes"] for e in run["epochs"]) / 2**20,
        "first_cycle_s": run["built_s"] + sum(e["load_s"] + e["rotation_wait_s"] for e in first),
        "load_s": statistics.median(e["load_s"] for e in later),
        "rotation_wait_s": statistics.median(e["rotation_wait_s"] for e in later),
        "run_s": run["run_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", type=int, default=16, help="synthetic spleen-like cases (default 16)")
    p.add_argument("--shape", type=int, nargs=3, default=(128, 128, 64), help="volume shape (default 128 128 64)")
    p.add_argument("--patch", type=int, nargs=3, default=(64, 64, 64), help="training crop (default 64^3)")
    p.add_argument("--window", type=int, default=4, help="items the SmartCache window holds (default 4)")
    p.add_argument("--replace-rate", type=float, default=0.5, help="share of the window replaced per epoch")
    p.add_argument("--cycles", type=int, default=2, help="passes of the rotation over the data set (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    args = p.parse_args(argv)
    if args.cycles < 2 or args.window < 1 or not 0 < args.replace_rate <= 1:
        p.error("--cycles must be >= 2 (the first cycle computes every item), --window >= 1, --replace-rate in (0, 1]")
    root = synthetic_dataset("spleen-like", args.cases, tuple(args.shape), 0, progress=False)
    train, val = load_msd_datalist(root, val_fraction=0.0001, seed=0)
    files = train + val
    runs = []
    with tempfile.TemporaryDirectory(prefix="smartcache-tier-") as tmp:
        for r in range(args.repeats):
            for v in VARIANTS:
                print(f"-- repeat {r + 1}: {v}", flush=True)
                runs.append({"repeat": r + 1, **run_once(files, args, v, Path(tmp) / f"{v}-{r}")})
    rows = [{"repeat": run["repeat"], **summarise(run)} for run in runs]
    for row in rows:
        ram = next(x for x in rows if x["repeat"] == row["repeat"] and x["variant"] == "ram")
        row["load_vs_ram"] = ram["load_s"] / row["load_s"]
    print(
        f"\n{'repeat':<7}{'variant':<8}{'window MiB':>11}{'cycle 1 s':>10}{'load s/ep':>10}{'wait s/ep':>10}"
        f"{'x ram':>7}"
    )
    for row in rows:
        print(
            f"{row['repeat']:<7}{row['variant']:<8}{row['window_ram_mib']:>11.1f}{row['first_cycle_s']:>10.1f}"
            f"{row['load_s']:>10.2f}{row['rotation_wait_s']:>10.3f}{row['load_vs_ram']:>6.2f}x"
        )
    tier = [r for r in rows if r["variant"] == "tier"]
    ram = [r for r in rows if r["variant"] == "ram"]
    summary = {
        "median_load_vs_ram": statistics.median(r["load_vs_ram"] for r in tier),
        "window_ram_mib": {v: max(r["window_ram_mib"] for r in rows if r["variant"] == v) for v in VARIANTS},
        "median_rotation_wait_s": {
            "ram": statistics.median(r["rotation_wait_s"] for r in ram),
            "tier": statistics.median(r["rotation_wait_s"] for r in tier),
        },
    }
    print(
        f"tier: loading per epoch {summary['median_load_vs_ram']:.2f}x the window in RAM's speed, window "
        f"{summary['window_ram_mib']['tier']:.1f} MiB in RAM against {summary['window_ram_mib']['ram']:.1f} MiB, "
        f"rotation wait {summary['median_rotation_wait_s']['tier']:.3f} s against "
        f"{summary['median_rotation_wait_s']['ram']:.3f} s"
    )
    doc = {
        "benchmark": "smartcache_tier",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"device": device_description("cpu"), "platform": platform.platform(), "torch": torch.__version__},
        "options": vars(args),
        "rows": rows,
        "runs": runs,
        **summary,
    }
    out = write_json(doc, Path(args.out) / f"smartcache_tier_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
