"""DDP scaling: training samples/s with 2 gloo ranks against 1, at equal per-rank batch.

Each configuration trains the demo's UNet (``fast`` recipe: DiceCE, Novograd, bf16 autocast where
this CPU gains from it) with DDP through ``monai_fast.distributed.run`` on in-memory patches, so
only compute and gradient all-reduce are timed. Per rank it also times the same step under
``no_sync()`` (compute alone) and one all-reduce of a gradient-sized buffer, the two numbers the
README's scaling model is built from.

Configurations (the machine has ``os.cpu_count()`` cores):
  1 rank x 1 thread   the single-"device" reference (one core, like one GPU)
  2 ranks x 1 thread  two "devices": the bar is >= 1.6x the reference
  1 rank x all cores  the same machine used by one process (intra-op threads instead of ranks)

    python benchmarks/ddp_scaling.py          # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _worker(local_rank: int, threads: int, steps: int, out: str, precision: str) -> None:
    from ignite import distributed as idist
    from monai.losses import DiceCELoss
    from monai.optimizers import Novograd

    from monai_fast.distributed.comm import allreduce_seconds
    from monai_fast.distributed.model import distribute
    from monai_fast.recipes import RecipeConfig
    from monai_fast.recipes.common import build_network
    from monai_fast.telemetry.precision import autocast_for

    torch.set_num_threads(threads)
    cfg = RecipeConfig().with_defaults(batch_size=2, num_samples=4)  # 8 patches a step, as the recorded runs
    device = idist.device()
    net = build_network(cfg, device)
    opt = Novograd(net.parameters(), lr=2e-3)
    net, opt = distribute(net, opt)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True, squared_pred=True, batch=True)
    batch = cfg.batch_size * cfg.num_samples
    x = torch.rand(batch, 1, *cfg.patch_size)
    y = torch.randint(0, 2, (batch, 1, *cfg.patch_size))

    def step(sync: bool) -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ctx = net.no_sync() if (not sync and hasattr(net, "no_sync")) else torch.enable_grad()
        with ctx:  # forward and backward inside: no_sync skips the gradient all-reduce
            with autocast_for(precision, device):
                loss = loss_fn(net(x), y)
            loss.backward()
        opt.step()
        return time.perf_counter() - t

    for _ in range(2):
        step(True)
    idist.barrier()
    t0 = time.perf_counter()
    synced = [step(True) for _ in range(steps)]
    idist.barrier()
    wall = time.perf_counter() - t0
    local = [step(False) for _ in range(max(3, steps // 2))]
    n = sum(p.numel() for p in net.parameters())
    reduce_s = allreduce_seconds(n)  # median, slowest rank
    rec = {
        "rank": idist.get_rank(),
        "world": idist.get_world_size(),
        "threads": threads,
        "batch_per_rank": batch,
        "wall_s": wall,
        "samples_per_s": idist.get_world_size() * batch * steps / wall,
        "step_s_median": statistics.median(synced),
        "compute_only_step_s_median": statistics.median(local),
        "allreduce_s_median": reduce_s,
        "gradient_mib": n * 4 / 2**20,
    }
    Path(out, f"rank{idist.get_rank()}.json").write_text(json.dumps(rec))


def run_config(world: int, threads: int, steps: int, precision: str) -> dict:
    from monai_fast.distributed import run

    out = tempfile.mkdtemp()
    run(_worker, threads, steps, out, precision, nproc_per_node=world if world > 1 else None, seed=0)
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    return {
        "world": world,
        "threads_per_rank": threads,
        "samples_per_s": ranks[0]["samples_per_s"],
        "step_s": max(r["step_s_median"] for r in ranks),
        "compute_only_step_s": max(r["compute_only_step_s_median"] for r in ranks),
        "allreduce_s": max(r["allreduce_s_median"] for r in ranks),
        "gradient_mib": ranks[0]["gradient_mib"],
        "batch_per_rank": ranks[0]["batch_per_rank"],
    }


def main(argv=None) -> int:
    import os

    from monai_fast.files import write_json
    from monai_fast.telemetry import device_description
    from monai_fast.telemetry.precision import choose_precision

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="alternating rounds of all configurations")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    precision = choose_precision("auto", "cpu")
    configs = [(1, 1), (2, max(1, cores // 2)), (1, cores)]
    rows: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    for r in range(args.repeats):  # alternate so drift on a shared host hits every configuration alike
        for world, threads in configs:
            res = run_config(world, threads, args.steps, precision)
            rows[(world, threads)].append(res)
            print(f"round {r + 1}: {world} rank(s) x {threads} thread(s): {res['samples_per_s']:.2f} samples/s", flush=True)
    med = {c: {k: statistics.median(x[k] for x in v) for k in v[0]} for c, v in rows.items()}
    ref = med[(1, 1)]["samples_per_s"]
    print(f"\n{'configuration':<22} {'samples/s':>10} {'vs 1x1':>7} {'step s':>8} {'compute s':>10} {'allreduce s':>12}")
    for (world, threads), m in med.items():
        print(f"{f'{world} rank x {threads} thr':<22} {m['samples_per_s']:>10.2f} {m['samples_per_s'] / ref:>6.2f}x "
              f"{m['step_s']:>8.3f} {m['compute_only_step_s']:>10.3f} {m['allreduce_s']:>12.4f}")
    two = med[(2, max(1, cores // 2))]
    print(f"\n2 ranks vs 1 (equal per-rank batch {two['batch_per_rank']:.0f} patches, one core each): "
          f"{two['samples_per_s'] / ref:.2f}x (bar >= 1.6x); gradient {two['gradient_mib']:.2f} MiB, "
          f"all-reduce {1000 * two['allreduce_s']:.1f} ms = {100 * two['allreduce_s'] / two['step_s']:.1f} % of a step")
    doc = {
        "benchmark": "ddp_scaling",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": device_description("cpu"),
        "precision": precision,
        "command": " ".join([sys.executable, *sys.argv]),
        "rounds": {f"{w}x{t}": v for (w, t), v in rows.items()},
        "median": {f"{w}x{t}": m for (w, t), m in med.items()},
        "speedup_2_ranks_vs_1": two["samples_per_s"] / ref,
        "speedup_2_ranks_vs_1_rank_all_cores": two["samples_per_s"] / med[(1, cores)]["samples_per_s"],
    }
    out = Path(args.out) / f"ddp_scaling_{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    write_json(doc, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
