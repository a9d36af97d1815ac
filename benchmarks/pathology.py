"""Patch classification on whole-slide images: the plain MONAI pipeline against the fast one.

Both pipelines of :mod:`monai_fast.apps.recipes.pathology` on the same synthetic Camelyon-like slides
(written once into the cache), interleaved and repeated, so a slow spell of the machine hits both:

* training **patches/s** (median over the epochs after the first, from ``ThroughputMonitor``) and
  the loader's share of iteration time (``TimeBreakdown``);
* **time to the target validation ROC AUC** (``TimeToTarget``; the clock starts before the data
  sets are built), and the best AUC reached.

Prints a markdown table and writes ``<out>/pathology_<time>.json`` with every run, the options,
the machine and what each pipeline chose (WSI reader, augmentation, precision)::

    python benchmarks/pathology.py                       # full size: gpu layout on CUDA, cpu size otherwise
    python benchmarks/pathology.py --size cpu --repeats 3 --target 0.95
    python benchmarks/pathology.py --tiny                # seconds: proves it runs (numbers mean nothing)
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from pathlib import Path

import monai
import torch

from monai_fast.apps.recipes.pathology import SIZES, VARIANTS, results_table, run_pathology
from monai_fast.apps.recipes.pathology_augment import cucim_status
from monai_fast.apps.sources.wsi import load_wsi_datalist, synthetic_wsi_dataset
from monai_fast.files import write_json
from monai_fast.telemetry import cuda_available, device_description


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda_available() else "cpu")
    p.add_argument("--size", choices=SIZES, help="default: gpu on CUDA, else cpu")
    p.add_argument("--tiny", action="store_true", help="--size tiny, 1 repeat, AUC 0.8: a smoke test")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=2, help="rounds of all variants, interleaved (default %(default)s)")
    p.add_argument("--target", type=float, help="validation ROC AUC (default 0.95; --tiny: 0.8)")
    p.add_argument("--max-epochs", type=int, help="default: the size's")
    p.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp16", "fp32"),
        default="auto",
        help="fast's AMPToggle (default %(default)s)",
    )
    p.add_argument("--time-budget", type=float, default=1800.0, help="seconds per run (default %(default)s)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    size_name = "tiny" if args.tiny else args.size or ("gpu" if device.type == "cuda" else "cpu")
    size = SIZES[size_name]
    repeats = 1 if args.tiny else args.repeats
    target = args.target if args.target is not None else 0.8 if args.tiny else 0.95
    cucim = cucim_status(device)
    print(
        f"{device_description(device)}; size {size_name}; cuCIM {'on' if cucim is None else 'off: ' + cucim}",
        flush=True,
    )

    root = synthetic_wsi_dataset(
        size.slides, size.shape, size.patch_size, tile=size.tile, levels=size.levels, progress=False
    )
    train, val = load_wsi_datalist(root)
    config = size.config(max_epochs=args.max_epochs, precision=args.precision)
    runs = []
    for repeat in range(1, repeats + 1):
        for variant in args.variants:  # interleaved
            r = run_pathology(variant, train, val, config, device, target=target, time_budget_s=args.time_budget)
            runs.append({**r, "repeat": repeat})
            reached = f"at {r['time_to_target_s']:.1f} s" if r["time_to_target_s"] else "not reached"
            print(
                f"repeat {repeat} {variant:<5} {r['patches_per_s'] or 0:.1f} patches/s, "
                f"best AUC {r['best_auc'] or 0:.3f}, "
                f"target {reached}",
                flush=True,
            )
    print(results_table(runs))
    for variant in args.variants:
        r = next(x for x in runs if x["variant"] == variant)
        print(f"{variant}: reader {r['reader']}; augmentation {r['augment']}; {r['optimizer']}, {r['precision']}")
    path = Path(args.out) / f"pathology_{time.strftime('%Y%m%d-%H%M%S')}.json"
    machine = {
        "device": device_description(device),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "monai": monai.__version__,
        "cucim": cucim or "available",
    }
    write_json(
        {
            "command": " ".join(sys.argv),
            "options": vars(args),
            "size": size_name,
            "target_auc": target,
            "data": str(root),
            "patches": {"training": len(train), "validation": len(val)},
            "machine": machine,
            "runs": runs,
        },
        path,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
