"""Peak RSS of a CacheDataset with 2 gloo ranks vs 1: a full copy per rank vs a per-rank partition.

MONAI issues #913 / #3843: with DDP, every rank building a ``CacheDataset`` over the whole data
list holds a full copy, so a node's RAM use grows with its rank count. With
:func:`monai_fast.data.planner.rank_partition`, each rank caches only its share. This script
measures the peak RSS growth of each rank while it builds the cache and iterates one epoch:

* 1 rank, all items;
* 2 real gloo ranks (``ignite.distributed.Parallel``), each caching all items;
* 2 gloo ranks, each caching its partition.

It prints a table and writes ``benchmarks/results/rank_cache_memory_<time>.json``.

    python benchmarks/rank_cache_memory.py --cases 16
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import tempfile
from pathlib import Path

import ignite.distributed as idist


def _measure(data_root: str, partition: bool, out_dir: str) -> None:
    from monai.data import CacheDataset, ThreadDataLoader
    from monai.transforms import Compose

    from monai_fast.apps.recipes import RecipeConfig
    from monai_fast.apps.recipes.transforms import deterministic_transforms, random_transforms
    from monai_fast.apps.sources.msd import load_msd_datalist
    from monai_fast.data.planner import rank_partition
    from monai_fast.telemetry.memory import PeakRSS

    with PeakRSS() as mem:
        cfg = RecipeConfig().with_defaults(batch_size=2, num_samples=4)  # as the recorded runs
        files, _ = load_msd_datalist(data_root, val_fraction=0.25)
        rank, world = idist.get_rank(), idist.get_world_size()
        mine = rank_partition(files, rank, world) if partition else files
        chain = Compose(
            deterministic_transforms(cfg, precompute_indices=True, plain_tensors=True)
            + random_transforms(cfg, precomputed_indices=True)
        )
        ds = CacheDataset(mine, chain, cache_rate=1.0, num_workers=1, progress=False, copy_cache=False)
        for batch in ThreadDataLoader(ds, batch_size=2, shuffle=True):
            _ = batch["image"].shape
    result = {"rank": rank, "items": len(mine), "peak_rss_growth_mib": mem.growth_mib}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _run(data_root: str, nproc: int, partition: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        if nproc == 1:
            _measure(data_root, partition, out)
        else:
            with idist.Parallel(backend="gloo", nproc_per_node=nproc, start_method="fork") as parallel:
                parallel.run(lambda local_rank: _measure(data_root, partition, out))
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=16)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    from monai_fast.apps.sources.synthetic import synthetic_dataset
    from monai_fast.telemetry import device_description

    root = str(synthetic_dataset("spleen-like", args.cases, (128, 128, 64), 0, progress=False))
    rows = []
    for label, nproc, partition in (
        ("1 rank, all items", 1, False),
        ("2 ranks, full copy each", 2, False),
        ("2 ranks, partition each", 2, True),
    ):
        ranks = _run(root, nproc, partition)
        total = sum(r["peak_rss_growth_mib"] for r in ranks)
        rows.append({"setup": label, "ranks": ranks, "node_total_mib": total})
    print(f"peak RSS growth while caching + one epoch ({args.cases} spleen-like cases, 12 for training)")
    print(f"{'setup':<26} {'items per rank':>15} {'per rank MiB':>18} {'node total MiB':>15}")
    for r in rows:
        items = "/".join(str(x["items"]) for x in r["ranks"])
        per = "/".join(f"{x['peak_rss_growth_mib']:.0f}" for x in r["ranks"])
        print(f"{r['setup']:<26} {items:>15} {per:>18} {r['node_total_mib']:>15.0f}")
    doc = {
        "benchmark": "rank_cache_memory",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"device": device_description("cpu"), "platform": platform.platform()},
        "rows": rows,
    }
    from monai_fast.files import write_json

    path = write_json(doc, Path(args.out) / f"rank_cache_memory_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
