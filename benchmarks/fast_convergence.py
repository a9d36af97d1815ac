"""Which of the ``fast`` recipe's optimisation settings buy its time to Dice, seed by seed.

Runs the ``fast`` recipe (same cache, precision and loader in every variant) to a validation
Dice target, changing only the optimisation options:

==================  ==========  ===========  ============
variant             optimizer   batch_size   num_samples
==================  ==========  ===========  ============
monai_tutorial      novograd    2            4
adamw               adamw       2            4
small_batches       novograd    1            2
fast                adamw       1            2   (the recipe's defaults)
==================  ==========  ===========  ============

Each variant runs ``--seeds`` seeds (weights, crops and augmentation differ); the table gives
epochs and seconds to the target per seed and their medians, and the JSON keeps every epoch's
Dice. Variants take turns seed by seed, so a slow spell of a shared machine hits all of them.

    python benchmarks/fast_convergence.py                 # about 6 minutes on 2 CPU cores
    python benchmarks/fast_convergence.py --seeds 0 1 2 3 4 5 --device cuda
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from pathlib import Path

import torch

from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.apps.training.run import run_to_target
from monai_fast.files import write_json
from monai_fast.telemetry import cuda_available, device_description

VARIANTS = {
    "monai_tutorial": {"optimizer": "novograd", "batch_size": 2, "num_samples": 4},
    "adamw": {"optimizer": "adamw", "batch_size": 2, "num_samples": 4},
    "small_batches": {"optimizer": "novograd", "batch_size": 1, "num_samples": 2},
    "fast": {},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2)")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--cases", type=int, default=16, help="synthetic cases (default 16, as the demo)")
    ap.add_argument(
        "--shape", type=int, nargs=3, default=[128, 128, 64], help="synthetic volume size (default 128 128 64)"
    )
    ap.add_argument("--target", type=float, default=0.9, help="validation mean Dice to reach (default 0.9)")
    ap.add_argument("--time-budget", type=float, default=150.0, help="seconds per run (default 150)")
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the JSON (default benchmarks/results)")
    args = ap.parse_args(argv)
    device = ("cuda" if cuda_available() else "cpu") if args.device == "auto" else args.device

    data = synthetic_dataset("spleen-like", args.cases, tuple(args.shape), 0, progress=False)
    train, val = load_msd_datalist(data, val_fraction=0.25, seed=0)
    runs: list[dict] = []
    for seed in args.seeds:
        for name in args.variants:
            cfg = RecipeConfig(seed=seed, max_epochs=200, **VARIANTS[name])
            r = run_to_target("fast", train, val, cfg, device, args.target, args.time_budget, progress=False)
            runs.append(
                {
                    "variant": name,
                    "seed": seed,
                    **VARIANTS[name],
                    "reached": r.reached,
                    "epochs_to_target": r.epochs_to_target,
                    "time_to_target_s": r.time_to_target_s,
                    "train_s_per_epoch": r.train_s_per_epoch,
                    "val_s_per_epoch": r.val_s_per_epoch,
                    "dice_per_epoch": [e.val_dice for e in r.epochs],
                    "notes": r.notes,
                }
            )
            got = f"{r.epochs_to_target} epochs, {r.time_to_target_s:.1f} s" if r.reached else "not reached"
            print(f"  seed {seed} {name:<15} {got}", flush=True)

    def cell(values: list) -> str:
        return "-" if not values else f"{statistics.median(values):.1f}"

    print(f"\n{'variant':<16} {'epochs per seed':<22} {'median':>7} {'seconds per seed':<28} {'median':>7}")
    summary = {}
    for name in args.variants:
        mine = [r for r in runs if r["variant"] == name]
        eps = [r["epochs_to_target"] for r in mine if r["reached"]]
        secs = [r["time_to_target_s"] for r in mine if r["reached"]]
        per_ep = " ".join(str(r["epochs_to_target"]) if r["reached"] else "-" for r in mine)
        per_s = " ".join(f"{r['time_to_target_s']:.1f}" if r["reached"] else "-" for r in mine)
        print(f"{name:<16} {per_ep:<22} {cell(eps):>7} {per_s:<28} {cell(secs):>7}")
        summary[name] = {
            "reached": f"{len(eps)}/{len(mine)}",
            "median_epochs": statistics.median(eps) if eps else None,
            "median_time_s": statistics.median(secs) if secs else None,
        }
    base = summary.get("monai_tutorial", {}).get("median_time_s")
    fast = summary.get("fast", {}).get("median_time_s")
    if base and fast:
        print(
            f"\nfast settings reach Dice {args.target} {base / fast:.2f}x sooner "
            "than the monai_tutorial settings (medians)"
        )
    stamp = dt.datetime.now()
    path = write_json(
        {
            "benchmark": "fast_convergence",
            "date": stamp.isoformat(timespec="seconds"),
            "machine": device_description(torch.device(device)),
            "command": " ".join(sys.argv),
            "options": vars(args),
            "data": str(data),
            "summary": summary,
            "runs": runs,
        },
        Path(args.out) / f"fast_convergence_{stamp:%Y%m%d-%H%M%S}.json",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
