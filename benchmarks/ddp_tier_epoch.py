"""A user's DDP trainer on one node: the shared crop tier (the user's sampler kept) against a partition per rank.

Each run is a real ``torchrun`` job of ``--ranks`` gloo ranks on this CPU. The trainer is written as a MONAI
user writes one for DDP: ``Dataset`` + ``DataLoader`` with ``DistributedSampler(shuffle=True)`` over the spleen
tutorial's chain (`your_trainer.py`'s), a 3D ``UNet`` in ``DistributedDataParallel``, ``DiceLoss``, ``Adam``.
``FastTraining`` is attached with the same levers in both variants (memory layout, compile, prefetch and the
evaluator off, so only the data path differs):

* ``shared``: the default on a CPU with a patch crop: one ``CropCacheDataset`` per node in a fresh folder, the
  user's ``DistributedSampler`` kept, every rank reading every item through the page cache;
* ``partition``: ``cache="ram"``, what FastTraining did before the shared tier: each rank caches its own fixed
  share of the items in RAM.

The variants take turns, repeat by repeat. The table gives the slowest rank's training seconds per epoch (epochs
after the first, median), the first epoch, the share of the data set rank 0 saw over the run, and the ratio
``partition / shared`` measured in the same repeat.

    python benchmarks/ddp_tier_epoch.py                 # about 6 minutes on 2 CPU cores
    python benchmarks/ddp_tier_epoch.py --ranks 2 --epochs 4 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import synthetic_dataset
from monai_fast.files import write_json
from monai_fast.telemetry import device_description

VARIANTS = ("shared", "partition")
HERE = Path(__file__).resolve().parent

RANK = """
import gc, json, sys, time
from pathlib import Path

import ignite.distributed as idist
import torch
from ignite.engine import Events
from monai.data import DataLoader, Dataset
from monai.engines import SupervisedTrainer
from monai.losses import DiceLoss
from monai.networks.nets import UNet
from monai.utils import set_determinism
from torch.utils.data import DistributedSampler

from your_trainer import tutorial_chain  # benchmarks/ is on PYTHONPATH

from monai_fast.handlers import FastTraining

variant, files, out, folder = sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]), sys.argv[4]
args = json.loads(Path(sys.argv[5]).read_text())
idist.initialize("gloo")
set_determinism(args["seed"])
t0 = time.perf_counter()
ds = Dataset(files, tutorial_chain(tuple(args["patch"]), True))
loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, shuffle=True, seed=args["seed"]))
channels = tuple(args["channels"])
net = UNet(3, 1, 2, channels=channels, strides=(2,) * (len(channels) - 1), num_res_units=2, norm="batch")
net = torch.nn.parallel.DistributedDataParallel(net)
trainer = SupervisedTrainer(
    device="cpu", max_epochs=args["epochs"], train_data_loader=loader, network=net,
    optimizer=torch.optim.Adam(net.parameters(), 1e-4), loss_function=DiceLoss(to_onehot_y=True, softmax=True),
)
same = dict(memory_format=False, compile=False, prefetch=False, evaluator=False, tune_store=None)
fast = FastTraining(cache_dir=folder, **same) if variant == "shared" else FastTraining(cache="ram", **same)
fast.attach(trainer)
setup_s = time.perf_counter() - t0
epochs, seen, start = [], set(), {}
trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: start.update(t=time.perf_counter()))


def note(engine):
    for item in engine.state.batch if isinstance(engine.state.batch, list) else [engine.state.batch]:
        name = getattr(item["image"], "meta", {}).get("filename_or_obj")
        if name is not None:
            seen.add(str(name))


trainer.add_event_handler(Events.ITERATION_COMPLETED, note)
trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: epochs.append(time.perf_counter() - start["t"]))
trainer.run()
slowest = [max(x) for x in zip(*idist.all_gather(torch.tensor(epochs)).reshape(idist.get_world_size(), -1).tolist())]
if idist.get_rank() == 0:
    out.write_text(json.dumps({
        "variant": variant, "setup_s": setup_s, "epochs_s": slowest, "rank0_items_seen": len(seen),
        "data": fast.applied["data"]["setting"], "reason": fast.applied["data"]["reason"],
    }))
del trainer, net, fast  # DDP's reducer goes before its process group: at exit after it, gloo can abort the rank
gc.collect()
idist.finalize()
"""


def run_once(variant: str, files_json: Path, args_json: Path, ranks: int, work: Path) -> dict:
    """One torchrun job of ``variant``; rank 0's result document."""
    work.mkdir(parents=True)
    script = work / "rank.py"
    script.write_text(RANK)
    out = work / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(script)]
    cmd += [variant, str(files_json), str(out), str(work / "crops"), str(args_json)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p),
    }
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"ddp_tier_epoch: the {variant} job failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks on this node (default 2)")
    p.add_argument("--cases", type=int, default=16, help="synthetic spleen-like cases (default 16)")
    p.add_argument("--shape", type=int, nargs=3, default=(128, 128, 64), help="volume shape (default 128 128 64)")
    p.add_argument("--patch", type=int, nargs=3, default=(64, 64, 64), help="training crop (default 64^3)")
    p.add_argument("--channels", type=int, nargs="+", default=(8, 16, 32, 64), help="UNet channels")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    p.add_argument("--repeats", type=int, default=2, help="runs per variant, in turns (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.epochs < 2 or args.repeats < 1:
        p.error("--ranks and --epochs must be at least 2 (the first epoch fills the caches), --repeats at least 1")
    root = synthetic_dataset("spleen-like", args.cases, tuple(args.shape), 0, progress=False)
    train, val = load_msd_datalist(root, val_fraction=0.0001, seed=0)
    files = train + val
    runs = []
    with tempfile.TemporaryDirectory(prefix="ddp-tier-") as tmp:
        files_json, args_json = Path(tmp) / "files.json", Path(tmp) / "args.json"
        files_json.write_text(json.dumps(files))
        args_json.write_text(json.dumps(vars(args)))
        for r in range(args.repeats):
            for v in VARIANTS:
                print(f"-- repeat {r + 1}: {v}", flush=True)
                runs.append({"repeat": r + 1, **run_once(v, files_json, args_json, args.ranks, Path(tmp) / f"{v}-{r}")})
    rows = []
    for run in runs:
        rows.append(
            {
                "repeat": run["repeat"],
                "variant": run["variant"],
                "data": run["data"],
                "first_epoch_s": run["epochs_s"][0],
                "epoch_s": statistics.median(run["epochs_s"][1:]),
                "rank0_items_share": run["rank0_items_seen"] / len(files),
            }
        )
    for row in rows:
        partition = next(x for x in rows if x["repeat"] == row["repeat"] and x["variant"] == "partition")
        row["partition_vs_shared"] = partition["epoch_s"] / row["epoch_s"] if row["variant"] == "shared" else None
    print(
        f"\n{'repeat':<7}{'variant':<11}{'cache':<7}{'epoch 1 s':>10}{'later s/ep':>11}{'rank 0 saw':>11}{'speed':>8}"
    )
    for row in rows:
        speed = "" if row["partition_vs_shared"] is None else f"{row['partition_vs_shared']:.2f}x"
        print(
            f"{row['repeat']:<7}{row['variant']:<11}{row['data']:<7}{row['first_epoch_s']:>10.1f}"
            f"{row['epoch_s']:>11.2f}{row['rank0_items_share']:>11.0%}{speed:>8}"
        )
    median = statistics.median(r["partition_vs_shared"] for r in rows if r["variant"] == "shared")
    print(f"shared tier per epoch: {median:.2f}x the partition's speed (the slowest of {args.ranks} ranks)")
    doc = {
        "benchmark": "ddp_tier_epoch",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"device": device_description("cpu"), "platform": platform.platform(), "torch": torch.__version__},
        "options": vars(args),
        "rows": rows,
        "runs": runs,
        "median_shared_speed_vs_partition": median,
    }
    out = write_json(doc, Path(args.out) / f"ddp_tier_epoch_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
