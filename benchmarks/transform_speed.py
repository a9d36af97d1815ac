"""How long each transform of the spleen chain takes, and which ones a cache takes out of every epoch.

Runs a recipe's training chain (``recipe_parts(name).cached_transforms()`` then
``.random_transforms()``: load, orient, resample, window, crop, pad, [crop indices, plain
tensors], then the random crops and augmentation) transform by transform on synthetic
spleen-like cases, on CPU tensors and, when CUDA is present, on GPU tensors: there the volume is
read from disk on the CPU, moved to the GPU by an extra ``ToDeviced`` row, and every later
transform runs on the GPU (the device is synchronised before each clock reading). A transform's
time is per volume (the random crop's ``num_samples`` crops and the augmentation of each crop
included), the median over cases x repeats, in ms, after one untimed pass.

A transform is *cached* when it lies in the deterministic head of the chain, before the first
random transform, the part MONAI's ``CacheDataset`` (and monai-fast's caches) run once when the
cache is filled, found the way ``CacheDataset`` finds it. The rest runs every epoch. The summary
gives, per device, the per-volume time of the head and of the tail and the share of an uncached
epoch's transform time that the cache removes. Prints a table and writes JSON.

    python benchmarks/transform_speed.py --cases 8 --shape 256 256 128 --repeats 3   # the real numbers
    python benchmarks/transform_speed.py --tiny                                        # a toy run
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from monai.transforms import Compose, MapTransform, Randomizable, ToDeviced, Transform, apply_transform
from monai.transforms.traits import RandomizableTrait

from monai_fast.apps.recipes import RECIPES, RecipeConfig, recipe_parts
from monai_fast.apps.recipes.transforms import KEYS
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.files import write_json
from monai_fast.telemetry import cuda_available, device_description, synchronize

TINY = {"cases": 2, "shape": (48, 48, 32), "repeats": 1, "patch": (32, 32, 32), "num_samples": 2}


def chain_of(recipe: str, config: RecipeConfig) -> tuple[list[MapTransform], int]:
    """The recipe's training chain and the length of its cached head (as ``CacheDataset`` computes it)."""
    parts = recipe_parts(recipe, config, "cpu")
    chain = parts.cached_transforms() + parts.random_transforms()
    first_random = Compose(chain).get_index_of_first(
        lambda t: isinstance(t, RandomizableTrait) or not isinstance(t, Transform)
    )
    return chain, len(chain) if first_random is None else first_random


def time_chain(
    chain: list[MapTransform], files: list[dict], device: torch.device, repeats: int, seed: int
) -> list[list[float]]:
    """Milliseconds of each transform (one list per transform, one value per case and repeat).

    On a CUDA ``device`` a ``ToDeviced`` is put after the first transform (the load) and timed as
    its own row, so the list is one longer than ``chain``.
    """
    steps = list(chain)
    if device.type == "cuda":
        steps.insert(1, ToDeviced(keys=list(KEYS), device=device))
    times: list[list[float]] = [[] for _ in steps]
    data: Any = dict(files[0])
    for t in steps:  # one untimed pass: first-call costs (imports, kernel set-up) are not a transform's
        data = apply_transform(t, data, map_items=True)
    for r in range(repeats):
        for i, t in enumerate(steps):
            if isinstance(t, Randomizable):
                t.set_random_state(seed=seed + 1000 * r + i)
        for item in files:
            data = dict(item)
            for row, t in enumerate(steps):
                start = time.perf_counter()
                data = apply_transform(t, data, map_items=True)
                synchronize(device)
                times[row].append((time.perf_counter() - start) * 1e3)
    return times


def rows_for(chain: list[MapTransform], head: int, by_device: dict[str, list[list[float]]]) -> list[dict]:
    """One row per transform: name, whether the cache removes it, the median ms per device (``None``: not run there)."""
    with_copy = "cuda" in by_device
    rows = [{"transform": type(t).__name__, "cached": i < head} for i, t in enumerate(chain)]
    if with_copy:
        rows.insert(1, {"transform": "ToDeviced", "cached": True})
    for device, times in by_device.items():
        if with_copy and device != "cuda":
            times = times[:1] + [[]] + times[1:]  # no copy to the GPU on the CPU
        for row, values in zip(rows, times):
            row[f"{device}_ms"] = statistics.median(values) if values else None
    return rows


def summarise(rows: list[dict], devices: list[str]) -> dict:
    """Per device: ms per volume in the cached head and in the per-epoch tail, and the share the cache removes."""
    summary = {}
    for device in devices:
        key = f"{device}_ms"
        head = sum(r[key] for r in rows if r["cached"] and r[key] is not None)
        tail = sum(r[key] for r in rows if not r["cached"] and r[key] is not None)
        summary[device] = {"cached_ms": head, "per_epoch_ms": tail, "cache_removes_share": head / (head + tail)}
    return summary


def print_table(rows: list[dict], summary: dict, devices: list[str]) -> None:
    print(f"\n{'transform':<26} {'cached':>6} " + " ".join(f"{d + ' ms':>10}" for d in devices))
    for r in rows:
        cells = " ".join(f"{r[d + '_ms']:>10.2f}" if r[d + "_ms"] is not None else f"{'-':>10}" for d in devices)
        print(f"{r['transform']:<26} {'yes' if r['cached'] else 'no':>6} {cells}")
    for d in devices:
        s = summary[d]
        print(
            f"{d}: cached head {s['cached_ms']:.1f} ms per volume (once, at cache fill), "
            f"tail {s['per_epoch_ms']:.1f} ms "
            f"every epoch: the cache removes {100 * s['cache_removes_share']:.0f} % of the epoch's transform time"
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="fast", choices=RECIPES, help="whose chain (default fast)")
    ap.add_argument("--cases", type=int, default=8, help="synthetic spleen-like cases (default 8)")
    ap.add_argument("--shape", type=int, nargs=3, default=(256, 256, 128), help="volume shape (default 256 256 128)")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the cases (default 3)")
    ap.add_argument("--patch", type=int, nargs=3, default=(96, 96, 96), help="crop size (default 96 96 96)")
    ap.add_argument("--num-samples", type=int, default=4, help="crops per volume (default 4)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: CPU, and CUDA if present")
    ap.add_argument("--tiny", action="store_true", help=f"a toy run: {TINY}")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the JSON (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    if args.cases < 1 or args.repeats < 1:
        ap.error("--cases and --repeats must be >= 1")
    if args.device == "cuda" and not cuda_available():
        ap.error("--device cuda: no CUDA device here")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    devices = [args.device] if args.device != "auto" else ["cpu"] + (["cuda"] if cuda_available() else [])
    data = synthetic_dataset("spleen-like", max(2, args.cases), tuple(args.shape), 0, progress=False)
    train, val = load_msd_datalist(data, val_fraction=0.5, seed=0)
    files = (train + val)[: args.cases]
    # fp32: no precision probe
    config = RecipeConfig(patch_size=tuple(args.patch), num_samples=args.num_samples, precision="fp32")
    chain, head = chain_of(args.recipe, config)
    by_device = {d: time_chain(chain, files, torch.device(d), args.repeats, seed=0) for d in devices}
    rows = rows_for(chain, head, by_device)
    summary = summarise(rows, devices)
    print_table(rows, summary, devices)
    stamp = dt.datetime.now()
    path = write_json(
        {
            "benchmark": "transform_speed",
            "date": stamp.isoformat(timespec="seconds"),
            "machine": {d: device_description(torch.device(d)) for d in devices},
            "command": " ".join(sys.argv),
            "options": vars(args),
            "recipe": args.recipe,
            "devices": devices,
            "cached_head_length": head,
            "transforms": rows,
            "summary": summary,
            "times_ms": by_device,
        },
        Path(args.out) / f"transform_speed_{stamp:%Y%m%d-%H%M%S}.json",
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
