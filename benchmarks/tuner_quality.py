"""Tuner quality: its pick against an exhaustive sweep of the same ranges, and what tuning costs.

For the demo's ``fast`` configuration on this machine:

1. exhaustive sweeps (``--rounds``, median per value): every training batch size in
   ``--batch-range`` and every sliding-window batch in ``--sw-range`` (on each validation
   device), timed like the tuner times a candidate;
2. the tuner (``monai_fast.apps.recipes.tuning.tune_recipe``, cache bypassed) over the same ranges;
   ``--tuner-runs`` times (a tuner's pick is itself a random variable on a noisy machine);
3. a head-to-head: the tuner's picks and the sweep's ``--top`` best values, measured again in
   ``--h2h-rounds`` interleaved rounds (a fresh random order each round) with longer timings;
4. one default ``fast`` training run to Dice 0.9 on the demo data (the cost tuning is compared to).

Quality is reported two ways. "sweep": the sweep's median at the pick over the sweep's best median;
the best of many noisy medians is biased upwards, so this understates the pick. "head-to-head"
(what the 5 % bar is judged on): the pick's median over the best candidate's median in the same
interleaved rounds, with a bootstrap 90 % interval over rounds. Prints a table, writes JSON.

    python benchmarks/tuner_quality.py            # about 8 minutes on 2 CPU cores
    python benchmarks/tuner_quality.py --tiny --device cpu   # toy size, seconds: proves the script runs
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from monai.losses import DiceCELoss

from monai_fast.apps.recipes import REGISTRY, RecipeConfig
from monai_fast.apps.recipes.parts import build_network, build_optimizer
from monai_fast.apps.recipes.tuning import default_space, tune_recipe, typical_val_shape
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.apps.training.run import run_to_target
from monai_fast.files import write_json
from monai_fast.telemetry import device_description
from monai_fast.tune import SearchSpace
from monai_fast.tune.measure import time_inference, time_training_step


def sweep(config: RecipeConfig, val_shape, device, space: SearchSpace, rounds: int) -> tuple[dict, dict, float]:
    """Every value of both ranges through the tuner's own trials (``strategy="grid"``), ``rounds``
    times; the median per value is the reference (single measurements on a shared machine scatter)."""
    train: dict = {}
    val: dict = {}
    seconds = 0.0
    for i in range(rounds):
        result = tune_recipe(
            config,
            val_shape,
            device,
            space=replace(space, strategy="grid", confirm=0),
            store=Path(tempfile.mkdtemp()) / "sweep.json",
            force=True,
        )
        seconds += result.tuning_s
        for t in result.trials:
            key = t["value"] if t["phase"] == "train" else (t["val_device"], t["value"])
            (train if t["phase"] == "train" else val).setdefault(key, []).append(t["throughput"] or 0.0)
        print(f"  sweep round {i + 1}/{rounds}: {result.tuning_s:.1f} s", flush=True)
    med = statistics.median
    return {k: med(v) for k, v in train.items()}, {k: med(v) for k, v in val.items()}, seconds


def source_version() -> str | None:
    """The checkout's commit, with ``+changes`` when the tree differs from it (``None`` outside git)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def head_to_head(
    config: RecipeConfig, val_shape, device, precision: str, train_values, val_values, rounds: int, seed: int = 0
) -> tuple[dict, dict]:
    """Throughput of each candidate in ``rounds`` interleaved rounds, in a fresh random order per
    round, timed like a tuner trial but longer (2 warm-up steps, then at least 4 steps and 1 s).

    Returns per-candidate lists (one reading per round): ``{batch: [...]}`` and ``{(device, sw): [...]}``.
    """
    config = config.with_defaults(**REGISTRY["fast"].defaults)
    net = build_network(config, device)
    opt = build_optimizer(config, net.parameters())
    loss = DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, batch=True)
    timing = {"warmup": 2, "min_iters": 4, "min_time_s": 1.0}
    rng = random.Random(seed)
    jobs = [("train", b) for b in train_values] + [("val", k) for k in val_values]
    train: dict = {b: [] for b in train_values}
    val: dict = {k: [] for k in val_values}
    for r in range(rounds):
        rng.shuffle(jobs)
        for phase, key in jobs:
            if phase == "train":
                patches = key * config.num_samples
                s = time_training_step(net, loss, opt, patches, config.patch_size, 1, 2, device, precision, **timing)
                train[key].append(patches / s)
            else:
                dev, sw = key
                s = time_inference(
                    net,
                    config.patch_size,
                    sw,
                    val_shape,
                    1,
                    device,
                    torch.device(dev),
                    precision,
                    config.sw_overlap,
                    **timing,
                )
                val[key].append(1.0 / s)
        print(f"  head-to-head round {r + 1}/{rounds}", flush=True)
    return train, val


def ratio_with_interval(samples: dict, pick, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Median at ``pick`` over the best median, and its bootstrap 5-95 % interval (rounds resampled)."""
    med = statistics.median
    point = med(samples[pick]) / max(med(v) for v in samples.values())
    rounds = len(samples[pick])
    rng = random.Random(seed)
    boots = []
    for _ in range(n_boot):
        idx = [rng.randrange(rounds) for _ in range(rounds)]
        meds = {k: med([v[i] for i in idx]) for k, v in samples.items()}
        boots.append(meds[pick] / max(meds.values()))
    boots.sort()
    return point, boots[int(0.05 * n_boot)], boots[int(0.95 * n_boot) - 1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-range", type=int, nargs=2, default=(1, 8))
    ap.add_argument("--sw-range", type=int, nargs=2, default=(1, 16))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--preset",
        choices=("demo", "small"),
        default="demo",
        help="demo: the fast recipe's UNet and 64^3 patches (flat curves on a CPU); small: a 4-8-16 UNet on "
        "32^3 patches, where per-step overhead makes throughput rise with the batch (default %(default)s)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="exhaustive sweeps, median per value (default %(default)s)")
    ap.add_argument("--tuner-runs", type=int, default=3, help="independent tuner runs (default %(default)s)")
    ap.add_argument(
        "--top", type=int, default=3, help="sweep's best values taken into the head-to-head (default %(default)s)"
    )
    ap.add_argument("--h2h-rounds", type=int, default=6, help="interleaved head-to-head rounds (default %(default)s)")
    ap.add_argument("--skip-training", action="store_true", help="no reference training run")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="toy size (4 small volumes, preset small, ranges 1-2, one round of each, no training run)",
    )
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.tiny:
        args.preset, args.batch_range, args.sw_range, args.skip_training = "small", (1, 2), (1, 2), True
        args.rounds = args.tuner_runs = args.top = args.h2h_rounds = 1
    device = torch.device(args.device)
    config = (
        RecipeConfig()
        if args.preset == "demo"
        else RecipeConfig(channels=(4, 8, 16), strides=(2, 2), num_res_units=0, patch_size=(32, 32, 32), num_samples=1)
    )
    root = synthetic_dataset(
        "spleen-like", *((4, (48, 48, 32)) if args.tiny else (16, (128, 128, 64))), 0, progress=False
    )
    train_files, val_files = load_msd_datalist(root, val_fraction=0.25, seed=0)
    val_shape = typical_val_shape(val_files, config)
    space = default_space(device, batch_range=tuple(args.batch_range), sw_batch_range=tuple(args.sw_range))
    print(f"device {device_description(device)}; validation volume {val_shape}; precision {space.precisions[0]}")

    print("exhaustive sweep:", flush=True)
    train, val, sweep_s = sweep(config, val_shape, device, space, args.rounds)
    results = []
    for i in range(args.tuner_runs):
        print(f"tuner run {i + 1}/{args.tuner_runs}:", flush=True)
        results.append(
            tune_recipe(
                config, val_shape, device, space=space, store=Path(tempfile.mkdtemp()) / "tune.json", force=True
            )
        )
        print(results[-1].table())
    precision = results[0].precision
    best_b = max(train, key=lambda b: train[b] or 0)
    best_v = max(val, key=lambda k: val[k] or 0)
    top_b = sorted(train, key=lambda b: -(train[b] or 0))[: args.top]
    top_v = sorted(val, key=lambda k: -(val[k] or 0))[: args.top]
    h_train_keys = sorted(set(top_b) | {r.batch_size for r in results})
    h_val_keys = sorted(set(top_v) | {(r.val_device, r.sw_batch_size) for r in results})
    print(f"head-to-head: batch sizes {h_train_keys}, sliding-window batches {h_val_keys}", flush=True)
    h_train, h_val = head_to_head(config, val_shape, device, precision, h_train_keys, h_val_keys, args.h2h_rounds)
    med = statistics.median

    fast_s = None
    if not args.skip_training and args.preset == "demo":
        print("reference: one default fast run to Dice 0.9", flush=True)
        r = run_to_target("fast", train_files, val_files, config, device, 0.9, 600.0, None, progress=False)
        fast_s = r.time_to_target_s if r.reached else r.total_s
        epoch_s = r.total_s / max(r.epochs_run, 1)
        full_s = epoch_s * config.max_epochs

    runs = []
    print(
        f"\n{'run':<4} {'setting':<22} {'pick':>10} {'sweep best':>11} {'sweep':>6} {'h2h best':>10} "
        f"{'head-to-head (90 % CI)':>24} {'tuning s':>9}"
    )
    for i, res in enumerate(results, 1):
        vkey = (res.val_device, res.sw_batch_size)
        tq, tlo, thi = ratio_with_interval(h_train, res.batch_size)
        vq, vlo, vhi = ratio_with_interval(h_val, vkey)
        run = {
            "batch_size": res.batch_size,
            "sw_batch_size": res.sw_batch_size,
            "val_device": res.val_device,
            "tuning_s": res.tuning_s,
            "trials_run": sum(not t["predicted"] for t in res.trials),
            "sweep_pick_over_best": {
                "train": (train[res.batch_size] or 0) / train[best_b],
                "val": (val[vkey] or 0) / val[best_v],
            },
            "h2h_pick_over_best": {"train": tq, "val": vq},
            "h2h_interval_90": {"train": [tlo, thi], "val": [vlo, vhi]},
            "tuning_share_of_default_run": None if fast_s is None else res.tuning_s / full_s,
            "tuner": res.to_dict(),
        }
        runs.append(run)
        h_best_b = max(h_train, key=lambda k: med(h_train[k]))
        h_best_v = max(h_val, key=lambda k: med(h_val[k]))
        print(
            f"{i:<4} {'training batch size':<22} {res.batch_size:>10} {best_b:>11} "
            f"{run['sweep_pick_over_best']['train']:>6.3f} {h_best_b:>10} {f'{tq:.3f} ({tlo:.3f}-{thi:.3f})':>24} "
            f"{res.tuning_s:>9.1f}"
        )
        print(
            f"{'':<4} {'sliding-window batch':<22} {f'{vkey[1]} ({vkey[0]})':>10} {f'{best_v[1]} ({best_v[0]})':>11} "
            f"{run['sweep_pick_over_best']['val']:>6.3f} {f'{h_best_v[1]} ({h_best_v[0]})':>10} "
            f"{f'{vq:.3f} ({vlo:.3f}-{vhi:.3f})':>24}"
        )
    print(
        "\nhead-to-head medians: training "
        + ", ".join(f"{k}: {med(v):.2f}" for k, v in h_train.items())
        + "; validation "
        + ", ".join(f"{k[1]} ({k[0]}): {med(v):.3f}" for k, v in h_val.items())
    )
    tuning = [r.tuning_s for r in results]
    print(
        f"tuning: {min(tuning):.1f}-{max(tuning):.1f} s per run; exhaustive sweeps: {sweep_s:.1f} s, "
        f"{args.rounds} x {len(train) + len(val)} trials"
    )
    if fast_s is not None:
        print(
            f"default fast run to Dice 0.9: {fast_s:.1f} s; tuning is {100 * max(tuning) / fast_s:.0f} % of it at most"
        )
        print(
            f"default fast run of RecipeConfig().max_epochs={config.max_epochs} epochs at {epoch_s:.2f} s/epoch: "
            f"{full_s:.0f} s; tuning is {100 * max(tuning) / full_s:.1f} % of it at most"
        )
    doc = {
        "benchmark": "tuner_quality",
        "preset": args.preset,
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": device_description(device),
        "command": " ".join([sys.executable, *sys.argv]),
        "source": source_version(),
        "validation_shape": list(val_shape),
        "precision": precision,
        "sweep": {
            "train_patches_per_s": train,
            "val_volumes_per_s": {f"{d}:{s}": v for (d, s), v in val.items()},
            "seconds": sweep_s,
            "rounds": args.rounds,
        },
        "head_to_head": {
            "rounds": args.h2h_rounds,
            "train_patches_per_s": {str(k): v for k, v in h_train.items()},
            "val_volumes_per_s": {f"{d}:{s}": v for (d, s), v in h_val.items()},
        },
        "tuner_runs": runs,
        "fast_run_to_dice_0_9_s": fast_s,
        "fast_default_run_s": None if fast_s is None else full_s,
    }
    out = Path(args.out) / f"tuner_quality_{args.preset}_{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    write_json(doc, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
