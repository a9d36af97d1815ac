"""Tuner quality: its pick against an exhaustive sweep of the same ranges, and what tuning costs.

For the demo's ``fast`` configuration on this machine:

1. exhaustive sweeps (``--rounds``, median per value): every training batch size in
   ``--batch-range`` and every sliding-window batch in ``--sw-range`` (on each validation
   device), timed like the tuner times a candidate;
2. the tuner (``monai_fast.tune.tune_recipe``, cache bypassed) over the same ranges;
3. one default ``fast`` training run to Dice 0.9 on the demo data (the cost tuning is compared to).

The pick's quality is the sweep's throughput at the pick over the sweep's best (same run, same
measurements), so noise between the two searches does not enter. Prints a table, writes JSON.

    python benchmarks/tuner_quality.py            # about 4 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from monai_fast.cli import synthetic_dataset
from monai_fast.data.msd import load_msd_datalist
from monai_fast.recipes import RecipeConfig
from monai_fast.recipes.runner import run_to_target
from monai_fast.report.compare import write_json_atomic
from monai_fast.telemetry import device_description
from monai_fast.tune import SearchSpace, default_space, tune_recipe, typical_val_shape


def sweep(config: RecipeConfig, val_shape, device, space: SearchSpace, rounds: int) -> tuple[dict, dict, float]:
    """Every value of both ranges through the tuner's own trials (``strategy="grid"``), ``rounds``
    times; the median per value is the reference (single measurements on a shared machine scatter)."""
    train: dict = {}
    val: dict = {}
    seconds = 0.0
    for i in range(rounds):
        result = tune_recipe(config, val_shape, device, space=replace(space, strategy="grid", confirm=0),
                             store=Path(tempfile.mkdtemp()) / "sweep.json", force=True)
        seconds += result.tuning_s
        for t in result.trials:
            key = t["value"] if t["phase"] == "train" else (t["val_device"], t["value"])
            (train if t["phase"] == "train" else val).setdefault(key, []).append(t["throughput"] or 0.0)
        print(f"  sweep round {i + 1}/{rounds}: {result.tuning_s:.1f} s", flush=True)
    med = statistics.median
    return {k: med(v) for k, v in train.items()}, {k: med(v) for k, v in val.items()}, seconds


def smoothed(curve: dict) -> dict:
    """Mean of each value's reading and its neighbours': throughput is smooth in the batch size, so this
    estimates the expected throughput and keeps a single lucky reading from becoming "the best"."""
    keys = sorted(curve)
    out = {}
    for i, k in enumerate(keys):
        window = [curve[keys[j]] or 0.0 for j in range(max(0, i - 1), min(len(keys), i + 2))]
        out[k] = sum(window) / len(window)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-range", type=int, nargs=2, default=(1, 8))
    ap.add_argument("--sw-range", type=int, nargs=2, default=(1, 16))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=("demo", "small"), default="demo",
                    help="demo: the fast recipe's UNet and 64^3 patches (flat curves on a CPU); small: a 4-8-16 UNet on "
                         "32^3 patches, where per-step overhead makes throughput rise with the batch (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="exhaustive sweeps, median per value (default %(default)s)")
    ap.add_argument("--skip-training", action="store_true", help="no reference training run")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    config = RecipeConfig() if args.preset == "demo" else RecipeConfig(
        channels=(4, 8, 16), strides=(2, 2), num_res_units=0, patch_size=(32, 32, 32), num_samples=1)
    root = synthetic_dataset("spleen-like", 16, (128, 128, 64), 0, progress=False)
    train_files, val_files = load_msd_datalist(root, val_fraction=0.25, seed=0)
    val_shape = typical_val_shape(val_files, config)
    space = default_space(device, batch_range=tuple(args.batch_range), sw_batch_range=tuple(args.sw_range))
    print(f"device {device_description(device)}; validation volume {val_shape}; precision {space.precisions[0]}")

    print("exhaustive sweep:", flush=True)
    train, val, sweep_s = sweep(config, val_shape, device, space, args.rounds)
    print("tuner:", flush=True)
    result = tune_recipe(config, val_shape, device, space=space, store=Path(tempfile.mkdtemp()) / "tune.json", force=True)
    print(result.table())
    best_b = max(train, key=lambda b: train[b] or 0)
    best_v = max(val, key=lambda k: val[k] or 0)
    train_q = (train[result.batch_size] or 0) / train[best_b]
    val_q = (val[(result.val_device, result.sw_batch_size)] or 0) / val[best_v]
    st = smoothed(train)
    sv = {}
    for dev in {d for d, _ in val}:
        sv.update({(dev, k): x for k, x in smoothed({s_: v for (d, s_), v in val.items() if d == dev}).items()})
    train_qs = st[result.batch_size] / max(st.values())
    val_qs = sv[(result.val_device, result.sw_batch_size)] / max(sv.values())

    fast_s = None
    if not args.skip_training and args.preset == "demo":
        print("reference: one default fast run to Dice 0.9", flush=True)
        r = run_to_target("fast", train_files, val_files, config, device, 0.9, 600.0, None, progress=False)
        fast_s = r.time_to_target_s if r.reached else r.total_s
        epoch_s = r.total_s / max(r.epochs_run, 1)
        full_s = epoch_s * config.max_epochs
    rows = [
        ("training batch size", f"{result.batch_size}", f"{best_b}", f"{train_q:.3f}", f"{train_qs:.3f}"),
        ("sliding-window batch", f"{result.sw_batch_size} ({result.val_device})", f"{best_v[1]} ({best_v[0]})",
         f"{val_q:.3f}", f"{val_qs:.3f}"),
    ]
    print(f"\n{'setting':<22} {'tuner pick':>12} {'sweep best':>12} {'pick/best':>10} {'smoothed':>9}")
    for row in rows:
        print(f"{row[0]:<22} {row[1]:>12} {row[2]:>12} {row[3]:>10} {row[4]:>9}")
    trials_run = sum(not t["predicted"] for t in result.trials)
    print(f"\ntuning: {result.tuning_s:.1f} s, {trials_run} trials; exhaustive sweeps: {sweep_s:.1f} s, "
          f"{args.rounds} x {len(train) + len(val)} trials")
    if fast_s is not None:
        print(f"default fast run to Dice 0.9: {fast_s:.1f} s; tuning is {100 * result.tuning_s / fast_s:.1f} % of it")
        print(f"default fast run of RecipeConfig().max_epochs={config.max_epochs} epochs at {epoch_s:.2f} s/epoch: "
              f"{full_s:.0f} s; tuning is {100 * result.tuning_s / full_s:.1f} % of it")
    doc = {
        "benchmark": "tuner_quality",
        "preset": args.preset,
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": device_description(device),
        "command": " ".join([sys.executable, *sys.argv]),
        "validation_shape": list(val_shape),
        "precision": space.precisions[0],
        "sweep": {"train_patches_per_s": train, "val_volumes_per_s": {f"{d}:{s}": v for (d, s), v in val.items()},
                  "seconds": sweep_s},
        "tuner": result.to_dict(),
        "pick_over_best": {"train": train_q, "val": val_q},
        "pick_over_best_smoothed": {"train": train_qs, "val": val_qs},
        "tuning_s": result.tuning_s,
        "fast_run_to_dice_0_9_s": fast_s,
        "tuning_share_of_fast_run": None if fast_s is None else result.tuning_s / fast_s,
        "fast_default_run_s": None if fast_s is None else full_s,
        "tuning_share_of_default_run": None if fast_s is None else result.tuning_s / full_s,
        "sweep_rounds": args.rounds,
    }
    out = Path(args.out) / f"tuner_quality_{args.preset}_{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    write_json_atomic(doc, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
