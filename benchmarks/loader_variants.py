"""Loader variants, after MONAI's dataset_type_performance notebook, on the demo's spleen-like data.

For each variant: time to build (cache fill), first and later epoch times of iterating the
training loader (the transforms only, no network), and the peak RSS growth of the process that
runs the loader (DataLoader worker processes are not counted). Variants: ``Dataset`` + ``DataLoader``
(workers), ``CacheDataset`` + ``ThreadDataLoader``, ``TrustedPersistentDataset`` (cold, then warm from
disk), ``CropCacheDataset`` (cold, then warm: memory-mapped arrays read by the patch),
``SmartCacheDataset`` (half cached, rotating), and on CUDA the GPU cache. Each variant runs in a
freshly forked process, so RSS figures do not leak into each other. (Spawned processes were tried first:
there, the DataLoader workers ran epochs 3-20x slower, which measured the process set-up, not the
loaders.) Prints a table and writes ``benchmarks/results/loader_variants_<time>.json``.

    python benchmarks/loader_variants.py --cases 16 --epochs 3
    python benchmarks/loader_variants.py --device cpu --cases 4 --epochs 2 --shape 48 48 32   # toy size
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import platform
import tempfile
import time
from pathlib import Path


def _run_variant(name, data_root, epochs, cache_dir, queue):
    import torch
    from monai.data import CacheDataset, DataLoader, Dataset, SmartCacheDataset, ThreadDataLoader
    from monai.transforms import Compose

    from monai_fast.apps.recipes import RecipeConfig
    from monai_fast.apps.recipes.transforms import deterministic_transforms, random_transforms
    from monai_fast.apps.sources.msd import load_msd_datalist
    from monai_fast.data.crop_cache import CropCacheDataset
    from monai_fast.data.persistent import TrustedPersistentDataset

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cfg = RecipeConfig().with_defaults(batch_size=2, num_samples=4)  # as the recorded runs
    files, _ = load_msd_datalist(data_root, val_fraction=0.25)
    cuda = name == "gpu_cache"
    chain = Compose(
        deterministic_transforms(
            cfg,
            precompute_indices=name != "dataset",
            plain_tensors=name != "dataset",
            device=torch.device("cuda") if cuda else None,
        )
        + random_transforms(cfg, precomputed_indices=name != "dataset")
    )

    def build():
        if name == "dataset":
            return DataLoader(
                Dataset(files, chain), batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.loader_workers
            )
        if name in ("cache", "gpu_cache"):
            ds = CacheDataset(
                files, chain, cache_rate=1.0, num_workers=cfg.cache_thread_count, progress=False, copy_cache=not cuda
            )
            return ThreadDataLoader(ds, batch_size=cfg.batch_size, shuffle=True, num_workers=0)
        if name.startswith("persistent"):
            ds = TrustedPersistentDataset(files, chain, cache_dir=cache_dir)
            return DataLoader(ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.loader_workers)
        if name.startswith("crop_cache"):
            ds = CropCacheDataset(files, chain, cache_dir=Path(cache_dir) / "crops")
            return DataLoader(ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.loader_workers)
        if name == "smartcache":
            ds = SmartCacheDataset(
                files,
                chain,
                cache_num=max(2, len(files) // 2),
                replace_rate=0.25,
                num_init_workers=cfg.cache_thread_count,
                progress=False,
            )
            return ThreadDataLoader(ds, batch_size=cfg.batch_size, shuffle=True, num_workers=0)
        raise ValueError(name)

    def run():
        t = time.perf_counter()
        loader = build()
        fill = time.perf_counter() - t
        ds = loader.dataset
        if name == "smartcache":
            ds.start()
        times = []
        for _ in range(epochs):
            t = time.perf_counter()
            for batch in loader:
                _ = batch["image"].shape
            times.append(time.perf_counter() - t)
            if name == "smartcache":
                ds.update_cache()
        if name == "smartcache":
            ds.shutdown()
        return fill, times

    from monai_fast.telemetry.memory import PeakRSS

    with PeakRSS() as mem:
        fill, times = run()
    queue.put(
        {
            "variant": name,
            "fill_s": fill,
            "first_epoch_s": times[0],
            "later_epoch_s": sum(times[1:]) / max(1, len(times) - 1),
            "peak_rss_growth_mib": mem.growth_mib,
        }
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--shape", type=int, nargs=3, default=(128, 128, 64), help="volume shape (default 128 128 64)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="cuda adds the GPU cache variant; auto: cuda when present (default %(default)s)",
    )
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    import torch

    from monai_fast.apps.sources.synthetic import synthetic_dataset
    from monai_fast.telemetry import device_description

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch build sees no CUDA device")
    root = synthetic_dataset("spleen-like", args.cases, tuple(args.shape), 0, progress=False)
    variants = [
        "dataset",
        "cache",
        "persistent_cold",
        "persistent_warm",
        "crop_cache_cold",
        "crop_cache_warm",
        "smartcache",
    ]
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        variants.append("gpu_cache")
    ctx = mp.get_context("fork")
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in variants:
            q = ctx.Queue()
            proc = ctx.Process(target=_run_variant, args=(name, root, args.epochs, cache_dir, q))
            proc.start()
            rows.append(q.get(timeout=1800))
            proc.join()
    head = f"{'variant':<16} {'fill s':>7} {'epoch 1 s':>10} {'later s':>8} {'peak RSS +MiB':>14}"
    print(f"loader variants on {device_description('cpu')}, {args.cases} spleen-like cases, {args.epochs} epochs")
    print(head)
    for r in rows:
        print(
            f"{r['variant']:<16} {r['fill_s']:>7.2f} {r['first_epoch_s']:>10.2f} {r['later_epoch_s']:>8.2f} "
            f"{r['peak_rss_growth_mib']:>14.0f}"
        )
    doc = {
        "benchmark": "loader_variants",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"device": device_description("cpu"), "platform": platform.platform()},
        "cases": args.cases,
        "epochs": args.epochs,
        "shape": list(args.shape),
        "rows": rows,
    }
    from monai_fast.files import write_json

    path = write_json(doc, Path(args.out) / f"loader_variants_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
