"""A node's memory for cached data with N gloo ranks vs 1: a full copy per rank, a partition, one shared copy.

MONAI issues #913 / #3843: with DDP, every rank building a ``CacheDataset`` over the whole data
list holds a full copy, so a node's RAM use grows with its rank count. With
:func:`monai_fast.data.planner.rank_partition`, each rank caches only its share. This script
measures the peak RSS growth of each rank while it builds the cache and iterates one epoch:

* 1 rank, all items;
* N real gloo ranks (``ignite.distributed.Parallel``), each caching all items;
* N gloo ranks, each caching its partition;
* N gloo ranks keeping the user's ``DistributedSampler``, as ``FastTraining`` adopts it: one
  ``CropCacheDataset`` per node, memory-mapped by every rank.

Beside the peak RSS growth, each rank's PSS growth (its share of pages it maps with others, from
``/proc``) is summed over the node; for the shared copy the size of its files is added (what the node's
page cache holds for them at most), so the "x 1 rank" column (node PSS + files over one rank's PSS) counts
it. The last column is the second loader pass's seconds on the slowest rank (the data path alone, no network).

It prints a table and writes ``benchmarks/results/rank_cache_memory_<time>.json``.

    python benchmarks/rank_cache_memory.py --cases 16
    python benchmarks/rank_cache_memory.py --cases 16 --ranks 2 4
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import tempfile
import time
from pathlib import Path

import ignite.distributed as idist


def _measure(data_root: str, mode: str, out_dir: str) -> None:
    import psutil
    from monai.data import CacheDataset, DataLoader, Dataset, ThreadDataLoader
    from monai.transforms import Compose
    from torch.utils.data import DistributedSampler

    from monai_fast.apps.recipes import RecipeConfig
    from monai_fast.apps.recipes.transforms import deterministic_transforms, random_transforms
    from monai_fast.apps.sources.msd import load_msd_datalist
    from monai_fast.data.adopt import adopt_loader
    from monai_fast.data.planner import rank_partition
    from monai_fast.telemetry.memory import PeakRSS

    pss_before = psutil.Process().memory_full_info().pss
    with PeakRSS() as mem:
        cfg = RecipeConfig().with_defaults(batch_size=2, num_samples=4)  # as the recorded runs
        files, _ = load_msd_datalist(data_root, val_fraction=0.25)
        rank, world = idist.get_rank(), idist.get_world_size()
        if mode == "shared":  # the user's loader with its DistributedSampler, adopted as FastTraining does
            chain = Compose(deterministic_transforms(cfg, plain_tensors=True) + random_transforms(cfg))
            ds = Dataset(files, chain)
            user = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, world, rank, shuffle=True, seed=0))
            loader = adopt_loader(user, "cpu", cache_dir=Path(out_dir) / "crops").loader
            mine = files
        else:
            mine = rank_partition(files, rank, world) if mode == "partition" else files
            chain = Compose(
                deterministic_transforms(cfg, precompute_indices=True, plain_tensors=True)
                + random_transforms(cfg, precomputed_indices=True)
            )
            ds = CacheDataset(mine, chain, cache_rate=1.0, num_workers=1, progress=False, copy_cache=False)
            loader = ThreadDataLoader(ds, batch_size=2, shuffle=True)
        epoch_s = []
        for _epoch in range(2):
            if isinstance(getattr(loader, "sampler", None), DistributedSampler):
                loader.sampler.set_epoch(_epoch)  # as a trainer does: the user's shuffle across ranks
            started = time.perf_counter()
            for batch in loader:
                _ = batch["image"].shape
            epoch_s.append(time.perf_counter() - started)
        pss_after = psutil.Process().memory_full_info().pss
    result = {
        "rank": rank,
        "items": len(mine),
        "peak_rss_growth_mib": mem.growth_mib,
        "pss_growth_mib": (pss_after - pss_before) / 2**20,
        "epoch_s": epoch_s,  # a loader pass each (the first after the fill); the second is the steady state
        # the shared copy's files: what the node's page cache holds for them at most, beside the processes' PSS
        "cache_files_mib": sum(f.stat().st_size for f in Path(out_dir, "crops").rglob("*") if f.is_file()) / 2**20
        if mode == "shared"
        else 0.0,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _run(data_root: str, nproc: int, mode: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        if nproc == 1:
            _measure(data_root, mode, out)
        else:
            with idist.Parallel(backend="gloo", nproc_per_node=nproc, start_method="fork") as parallel:
                parallel.run(lambda local_rank: _measure(data_root, mode, out))
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=16)
    p.add_argument("--ranks", type=int, nargs="+", default=[2], help="ranks on the node to compare (default 2)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    from monai_fast.apps.sources.synthetic import synthetic_dataset
    from monai_fast.telemetry import device_description

    root = str(synthetic_dataset("spleen-like", args.cases, (128, 128, 64), 0, progress=False))
    rows = []
    setups = [("1 rank, all items", 1, "full")]
    for n in args.ranks:
        setups += [
            (f"{n} ranks, full copy each", n, "full"),
            (f"{n} ranks, partition each", n, "partition"),
            (f"{n} ranks, sampler kept, shared", n, "shared"),
        ]
    for label, nproc, mode in setups:
        ranks = _run(root, nproc, mode)
        total = sum(r["peak_rss_growth_mib"] for r in ranks)
        pss = sum(r["pss_growth_mib"] for r in ranks)
        files = max(r["cache_files_mib"] for r in ranks)  # one copy per node, read by every rank
        second = max(r["epoch_s"][-1] for r in ranks)  # the slowest rank sets a DDP epoch's pace
        rows.append(
            {
                "setup": label,
                "ranks": ranks,
                "node_total_mib": total,
                "node_pss_mib": pss,
                "cache_files_mib": files,
                "second_epoch_s": second,
            }
        )
    one = rows[0]["node_pss_mib"] or float("nan")
    print(f"memory growth while caching + two epochs ({args.cases} spleen-like cases, 12 for training)")
    print(
        f"{'setup':<31} {'items per rank':>15} {'peak RSS per rank':>18} {'node RSS MiB':>13} {'node PSS MiB':>13}"
        f" {'+ files MiB':>12} {'x 1 rank':>9} {'epoch 2 s':>10}"
    )
    for r in rows:
        items = "/".join(str(x["items"]) for x in r["ranks"])
        per = "/".join(f"{x['peak_rss_growth_mib']:.0f}" for x in r["ranks"])
        print(
            f"{r['setup']:<31} {items:>15} {per:>18} {r['node_total_mib']:>13.0f} {r['node_pss_mib']:>13.0f}"
            f" {r['cache_files_mib']:>12.0f} {(r['node_pss_mib'] + r['cache_files_mib']) / one:>9.2f}"
            f" {r['second_epoch_s']:>10.2f}"
        )
    doc = {
        "benchmark": "rank_cache_memory",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"device": device_description("cpu"), "platform": platform.platform()},
        "ranks": args.ranks,
        "rows": rows,
    }
    from monai_fast.files import write_json

    path = write_json(doc, Path(args.out) / f"rank_cache_memory_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
