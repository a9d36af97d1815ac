"""Does filling the cache in the background shorten the time to the first step and to the end of epoch 2?

Trains the ``fast`` recipe's parts (its transforms, network, loss and optimizer; no validation)
over the planner's cache built two ways, alternating: ``foreground`` (the cache is full
before the first step) and ``background`` (``CachePlan.build(background=True)``, the loader
ordered by ``fill_order_options``). The clock starts before the cache is built. Reported per
variant (medians of the repeats): seconds to the end of the first iteration and to the end of
epoch 2, and the ratio background / foreground per pair. Prints a table and writes JSON.

    python benchmarks/background_fill.py --repeats 3 --cases 40 --shape 128 128 96    # the real numbers
    python benchmarks/background_fill.py --repeats 1 --cases 4 --shape 32 32 32       # a toy run
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import torch
from ignite.engine import Events
from monai.engines import SupervisedTrainer

from monai_fast.apps.recipes import RecipeConfig, recipe_parts
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.data.background import fill_order_options
from monai_fast.data.loaders import SafeThreadDataLoader
from monai_fast.data.planner import plan_cache
from monai_fast.files import write_json
from monai_fast.telemetry import cuda_available, device_description

VARIANTS = ("foreground", "background")


def one_run(train: list[dict], background: bool, config: RecipeConfig, device: str) -> dict:
    """Seconds from the start of the cache build to the first iteration's end and to epoch 2's end."""
    torch.manual_seed(0)
    parts = recipe_parts("fast", config, device)
    chain = parts.train_transforms()
    start = time.perf_counter()
    plan = plan_cache(chain, train, device)
    ds = plan.build(train, chain, background=background)
    loader = SafeThreadDataLoader(ds, batch_size=parts.config.batch_size, **fill_order_options(ds, shuffle=True))
    net = parts.network(device)
    trainer = SupervisedTrainer(
        device=torch.device(device),
        max_epochs=2,
        train_data_loader=loader,
        network=net,
        optimizer=parts.optimizer(net.parameters()),
        loss_function=parts.loss(),
    )
    stamps: dict = {}
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED(once=1), lambda e: stamps.__setitem__("first", time.perf_counter())
    )
    trainer.run()
    end = time.perf_counter()
    if background:
        ds.shutdown()
    return {
        "variant": VARIANTS[background],
        "where": plan.where,
        "first_iteration_s": stamps["first"] - start,
        "epoch2_end_s": end - start,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant, alternating (default 3)")
    ap.add_argument("--cases", type=int, default=40, help="synthetic cases (default 40; 3/4 train)")
    ap.add_argument("--shape", type=int, nargs=3, default=(128, 128, 96), help="volume shape (default 128 128 96)")
    ap.add_argument("--device", default="auto", help="cpu, cuda ... (default: cuda if present)")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the JSON (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.cases < 4:
        ap.error("--repeats must be >= 1 and --cases >= 4")
    device = ("cuda" if cuda_available() else "cpu") if args.device == "auto" else args.device
    data = synthetic_dataset("spleen-like", args.cases, tuple(args.shape), 0, progress=False)
    train, _ = load_msd_datalist(data, val_fraction=0.25, seed=0)
    config = RecipeConfig(max_epochs=2, patch_size=tuple(min(96, s) for s in args.shape))
    runs = []
    for i in range(args.repeats):
        for background in (False, True):
            r = one_run(train, background, config, device)
            runs.append(r)
            print(
                f"  run {i + 1} {r['variant']:>10} ({r['where']}): first iteration {r['first_iteration_s']:.2f} s, "
                f"end of epoch 2 {r['epoch2_end_s']:.2f} s",
                flush=True,
            )
    summary: dict = {}
    print(f"\n{'variant':>10} {'first iteration s':>18} {'end of epoch 2 s':>17}   (medians of {args.repeats})")
    for name in VARIANTS:
        mine = [r for r in runs if r["variant"] == name]
        summary[name] = {k: statistics.median(r[k] for r in mine) for k in ("first_iteration_s", "epoch2_end_s")}
        print(f"{name:>10} {summary[name]['first_iteration_s']:>18.2f} {summary[name]['epoch2_end_s']:>17.2f}")
    for key in ("first_iteration_s", "epoch2_end_s"):
        ratios = [b[key] / a[key] for a, b in zip(runs[0::2], runs[1::2])]
        summary[f"{key}_background_over_foreground"] = {"per_pair": ratios, "median": statistics.median(ratios)}
        print(f"{key} background / foreground per pair: {' '.join(f'{x:.3f}' for x in ratios)}")
    stamp = dt.datetime.now()
    path = write_json(
        {
            "benchmark": "background_fill",
            "date": stamp.isoformat(timespec="seconds"),
            "machine": device_description(torch.device(device)),
            "command": " ".join(sys.argv),
            "options": vars(args),
            "summary": summary,
            "runs": runs,
        },
        Path(args.out) / f"background_fill_{stamp:%Y%m%d-%H%M%S}.json",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
