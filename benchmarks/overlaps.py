"""The overlaps' two ratios, measured in one run: ``fast`` to a Dice target with its overlaps on and off.

Variants (the same recipe, data and seeds; they take turns repeat by repeat, so a slow spell of a
shared machine hits each):

* ``off``: the cache fills before the first step, full validation after every epoch;
* ``schedule``: ``fast``'s default: a cheap estimate decides when the full validation runs
  (``RecipeConfig(validation="schedule")``), the cache still fills first;
* ``on``: the schedule and the cache filling while training runs (``background_fill=True``).

Each run goes to a *stable* target (two consecutive full validations at or above it; only a full
validation of the whole validation set declares it) and records, on the wall clock from before the
data sets are built: the visible set-up, each epoch's training window (first batch asked to last
iteration done), the time to the first and the stable target, and the CPU seconds of the process
(all threads). The table gives per variant:

* ``first / train``: time to the first target over the training windows up to that epoch (the
  issue's first bar: <= 1.5x);
* ``off / variant``: the ``off`` run's time to target over this variant's, same repeat (its second
  bar: >= 1.8x for ``on``);
* ``CPU floor``: the run's CPU seconds up to the first target over the CPUs it may use: overlapping
  the same work on these CPUs cannot finish much sooner (the CPU seconds include OpenMP's
  spin-waiting, so it is an estimate, not a strict bound). ``off / floor``: the ``off`` run's time
  over this run's floor, about the most the second bar could reach with this variant's work here.

On CUDA each run also samples the GPU (``GPUSampler``, every 0.2 s) and gives the mean
utilisation inside the training windows (the issue: not lower with the overlaps). With
``--fixed-epochs N`` each variant also trains N epochs without stopping and validates the whole
validation set once at the end: the Dice the overlaps must leave unchanged (+-0.01).

    python benchmarks/overlaps.py --repeats 2                                   # 40 volumes of 128x128x96
    python benchmarks/overlaps.py --repeats 2 --cases 16 --shape 128 128 64     # monai-fast bench's default set
    python benchmarks/overlaps.py --cases 6 --shape 48 48 32 --patch 32 32 32 --target 0.05 --repeats 1  # a toy run
    python benchmarks/overlaps.py --recompute benchmarks/results/overlaps_<time>.json     # a saved run's table again

Prints the table and writes ``<out>/overlaps_<time>.json`` with every epoch of every run.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ignite.engine import Events
from time_to_dice import recipe_sizes  # benchmarks/, the same command-line sizes

from monai_fast.apps.recipes import VAL_METRIC, RecipeConfig, build_recipe
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.files import write_json
from monai_fast.handlers import GPUSampler, TimeToTarget
from monai_fast.telemetry import cuda_available, device_description
from monai_fast.telemetry.host import process_tree_cpu_seconds

VARIANTS: dict[str, dict] = {
    "off": {"validation": "every_epoch", "background_fill": False},
    "schedule": {"validation": "schedule", "background_fill": False},
    "on": {"validation": "schedule", "background_fill": True},
}


@dataclass
class Windows:
    """Each epoch's training window (wall and CPU seconds) and the CPU seconds at each full validation."""

    t0: float
    epochs: list[dict] = field(default_factory=list)
    cpu_at_validation: dict[int, float] = field(default_factory=dict)

    def attach(self, trainer, evaluator) -> None:
        trainer.add_event_handler(Events.EPOCH_STARTED, self._started)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._iteration)
        evaluator.add_event_handler(
            Events.COMPLETED, lambda _: self.cpu_at_validation.update({trainer.state.epoch: process_tree_cpu_seconds()})
        )

    def _started(self, engine) -> None:
        self.epochs.append(
            {
                "epoch": engine.state.epoch,
                "start_s": time.perf_counter() - self.t0,
                "unix_start": time.time(),
                "cpu_start": process_tree_cpu_seconds(),
            }
        )

    def _iteration(self, engine) -> None:
        if engine.state.iteration % engine.state.epoch_length == 0:  # the epoch's last iteration
            e = self.epochs[-1]
            e.update(end_s=time.perf_counter() - self.t0, unix_end=time.time(), cpu_end=process_tree_cpu_seconds())
            e["train_s"], e["train_cpu_s"] = e["end_s"] - e["start_s"], e["cpu_end"] - e["cpu_start"]

    def train_s(self, upto: int | None) -> float:
        return sum(e.get("train_s", 0.0) for e in self.epochs if upto is None or e["epoch"] <= upto)


def _gpu_util_in(csv_path: Path, unix_t0: float, windows: list[dict]) -> float | None:
    """Mean GPU utilisation of the samples inside the training windows."""
    if not csv_path.exists():
        return None
    with open(csv_path) as f:
        rows = [(unix_t0 + float(r["time"]), float(r["gpu_util"])) for r in csv.DictReader(f) if r["gpu_util"] != "nan"]
    inside = [u for t, u in rows if any(w["unix_start"] <= t <= w.get("unix_end", -1) for w in windows)]
    return statistics.mean(inside) if inside else None


def run_variant(
    variant: str,
    args: argparse.Namespace,
    files: tuple[list, list],
    seed: int,
    device: str,
    fixed_epochs: int | None = None,
) -> dict:
    """One run of ``fast`` the ``variant`` way: to the stable target, or ``fixed_epochs`` then a full validation."""
    t0, cpu0 = time.perf_counter(), process_tree_cpu_seconds()
    config = RecipeConfig(
        max_epochs=fixed_epochs or args.max_epochs,
        seed=seed,
        val_target=args.target,
        **VARIANTS[variant],
        **recipe_sizes(args),
    )
    built = build_recipe("fast", files[0], files[1], config, device, progress=False)
    setup_s, setup_cpu_s = time.perf_counter() - t0, process_tree_cpu_seconds() - cpu0
    trainer, evaluator = built.trainer, built.evaluator
    windows = Windows(t0)
    windows.attach(trainer, evaluator)
    stopper = None
    if fixed_epochs is None:
        stopper = TimeToTarget(
            args.target, metric_name=VAL_METRIC, time_budget_s=args.time_budget, start_time=t0, stop_on="stable"
        )
        stopper.attach(trainer, evaluator)
    with tempfile.TemporaryDirectory() as tmp:
        sampler = GPUSampler(interval_s=0.2, output_dir=tmp) if torch.device(device).type == "cuda" else None
        started: dict = {}
        if sampler is not None:  # its CSV's times count from its own start: note ours right after it
            sampler.attach(trainer)
            trainer.add_event_handler(Events.STARTED, lambda _: started.setdefault("unix", time.time()))
        trainer.run()
        gpu_util = None
        if sampler is not None and sampler.active:
            gpu_util = _gpu_util_in(
                next(Path(tmp).glob("gpu_rank*.csv"), Path(tmp) / "none"), started["unix"], windows.epochs
            )
    out = {
        "variant": variant,
        "seed": seed,
        "setup_s": setup_s,
        "setup_cpu_s": setup_cpu_s,
        "epochs": windows.epochs,
        "epochs_run": trainer.state.epoch,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": process_tree_cpu_seconds() - cpu0,
        "gpu_util_training": gpu_util,
        "notes": list(built.notes),
    }
    if fixed_epochs is not None:
        evaluator.run()  # the whole validation set at the final weights, the recipe's settings
        out["final_dice"] = float(evaluator.state.metrics[VAL_METRIC])
        return out
    first_epoch = stopper.reached_epoch
    out.update(
        first_s=stopper.reached_s,
        first_epoch=first_epoch,
        stable_s=stopper.stable_s,
        stable_epoch=stopper.stable_epoch,
        full_validations=len(stopper.history),
        best_dice=stopper.best,
        train_s_to_first=windows.train_s(first_epoch) if first_epoch else None,
        cpu_s_to_first=windows.cpu_at_validation.get(first_epoch, float("nan")) - cpu0 if first_epoch else None,
    )
    return out


def _med(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(runs: list[dict], cpus: int) -> dict:
    """Per variant: medians of the times, the first bar's ratio, the CPU floor, and off / variant per repeat."""
    off = {r["seed"]: r for r in runs if r["variant"] == "off" and "first_s" in r}
    rows = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant and "first_s" in r]
        if not mine:
            continue
        reached = [r for r in mine if r["first_s"]]
        speedups = [off[r["seed"]]["first_s"] / r["first_s"] for r in reached if off.get(r["seed"], {}).get("first_s")]
        stable = [
            off[r["seed"]]["stable_s"] / r["stable_s"]
            for r in mine
            if r["stable_s"] and off.get(r["seed"], {}).get("stable_s")
        ]
        fixed = [r["final_dice"] for r in runs if r["variant"] == variant and "final_dice" in r]
        rows[variant] = {
            "reached": f"{len(reached)}/{len(mine)}",
            "setup_s": _med([r["setup_s"] for r in mine]),
            "first_s": _med([r["first_s"] for r in mine]),
            "stable_s": _med([r["stable_s"] for r in mine]),
            "train_s_to_first": _med([r["train_s_to_first"] for r in reached]),
            "first_over_train": _med([r["first_s"] / r["train_s_to_first"] for r in reached]),
            "cpu_floor_s": _med([r["cpu_s_to_first"] / cpus for r in reached]),
            "floor_over_train": _med([r["cpu_s_to_first"] / cpus / r["train_s_to_first"] for r in reached]),
            "off_over_this_first": speedups,
            "off_over_this_stable": stable,
            # the most this variant's own work allows: off's time over this run's CPU floor
            "off_over_this_floor": [
                off[r["seed"]]["first_s"] / (r["cpu_s_to_first"] / cpus)
                for r in reached
                if off.get(r["seed"], {}).get("first_s")
            ],
            "epochs_to_first": _med([r["first_epoch"] for r in reached]),
            "full_validations": _med([r["full_validations"] for r in mine]),
            "gpu_util_training": _med([r["gpu_util_training"] for r in mine]),
            "fixed_epoch_dice": fixed,
        }
    return rows


def table(rows: dict) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    head = (
        f"{'variant':<9}{'reached':>8}{'set-up s':>9}{'first s':>8}{'stable s':>9}{'train s':>8}{'first/train':>12}"
        f"{'CPU floor s':>12}{'floor/train':>12}{'off/this first':>16}{'off/this stable':>17}{'off/floor':>16}"
        f"{'GPU util %':>11}"
        f"{'fixed-epoch Dice':>18}"
    )
    lines = [head]
    for variant, r in rows.items():
        lines.append(
            f"{variant:<9}{r['reached']:>8}{f(r['setup_s']):>9}{f(r['first_s']):>8}{f(r['stable_s']):>9}"
            f"{f(r['train_s_to_first']):>8}{f(r['first_over_train'], '.2f') + 'x':>12}{f(r['cpu_floor_s']):>12}"
            f"{f(r['floor_over_train'], '.2f') + 'x':>12}"
            f"{' '.join(format(s, '.2f') for s in r['off_over_this_first']) or '-':>16}"
            f"{' '.join(format(s, '.2f') for s in r['off_over_this_stable']) or '-':>17}"
            f"{' '.join(format(s, '.2f') for s in r['off_over_this_floor']) or '-':>16}{f(r['gpu_util_training']):>11}"
            f"{' '.join(format(d, '.3f') for d in r['fixed_epoch_dice']) or '-':>18}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="variants, in this order within a repeat (default: all)",
    )
    p.add_argument("--repeats", type=int, default=2, help="rounds of all variants, seeds seed, seed+1, ... (default 2)")
    p.add_argument("--target", type=float, default=0.9, help="validation mean Dice to reach, in (0, 1] (default 0.9)")
    p.add_argument("--time-budget", type=float, default=1200.0, help="seconds per run (default 1200)")
    p.add_argument("--max-epochs", type=int, default=200, help="epoch limit per run (default 200)")
    p.add_argument(
        "--fixed-epochs",
        type=int,
        default=0,
        help="also train each variant this many epochs and compare the final Dice (default 0: not)",
    )
    p.add_argument("--data-dir", help="an MSD-layout folder with dataset.json; default: synthetic spleen-like data")
    p.add_argument("--cases", type=int, default=40, help="synthetic spleen-like cases (default 40)")
    p.add_argument("--shape", type=int, nargs=3, default=(128, 128, 96), help="volume size (default 128 128 96)")
    p.add_argument("--patch", type=int, nargs=3, help="training crop / sliding window (default: the recipe's)")
    p.add_argument("--channels", type=int, nargs="+", help="UNet channels, stride 2 each (default: the recipe's)")
    p.add_argument("--res-units", type=int, help="UNet residual units per level (default: the recipe's)")
    p.add_argument("--seed", type=int, default=0, help="first training seed; the data's is 0 (default 0)")
    p.add_argument("--device", default="auto", help="'auto' (CUDA if present), 'cpu', 'cuda' (default auto)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    p.add_argument(
        "--recompute",
        metavar="JSON",
        help="print the table of a saved run with this script's summary "
        "(and write it back into that file), without running anything",
    )
    args = p.parse_args(argv)
    if args.recompute:
        doc = json.loads(Path(args.recompute).read_text())
        doc["summary"] = summarise(doc["runs"], doc["machine"]["cpus"])
        write_json(doc, Path(args.recompute))
        print(table(doc["summary"]))
        return 0
    if args.repeats < 1 or args.max_epochs < 1 or args.fixed_epochs < 0 or not 0 < args.target <= 1:
        p.error("--repeats and --max-epochs must be >= 1, --fixed-epochs >= 0, --target in (0, 1]")
    device = ("cuda" if cuda_available() else "cpu") if args.device == "auto" else args.device
    root = (
        Path(args.data_dir)
        if args.data_dir
        else synthetic_dataset("spleen-like", args.cases, tuple(args.shape), 0, progress=False)
    )
    files = load_msd_datalist(root, val_fraction=0.25, seed=0)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for variant in args.variants:
            r = run_variant(variant, args, files, args.seed + repeat, device)
            runs.append(r)
            print(
                f"repeat {repeat + 1} {variant:<9} first {r['first_s'] or float('nan'):.1f} s "
                f"(epoch {r['first_epoch']}), "
                f"stable {r['stable_s'] or float('nan'):.1f} s, set-up {r['setup_s']:.1f} s, "
                f"training {r['train_s_to_first'] or float('nan'):.1f} s",
                flush=True,
            )
            if args.fixed_epochs:
                r = run_variant(variant, args, files, args.seed + repeat, device, fixed_epochs=args.fixed_epochs)
                runs.append(r)
                print(
                    f"repeat {repeat + 1} {variant:<9} {args.fixed_epochs} epochs: Dice {r['final_dice']:.4f}",
                    flush=True,
                )
    rows = summarise(runs, cpus)
    print("\n" + table(rows))
    print(
        f"\ndevice: {device_description(device)}; {cpus} CPUs; medians over {args.repeats} repeat(s); "
        "'off/this' per repeat"
    )
    doc = {
        "benchmark": "overlaps",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "device": device_description(device),
            "cpus": cpus,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "options": vars(args),
        "summary": rows,
        "runs": runs,
    }
    out = write_json(doc, Path(args.out) / f"overlaps_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
