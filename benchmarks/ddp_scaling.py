"""DDP scaling: training samples/s with 2 gloo ranks against 1, at equal per-rank batch; 2 "nodes" on localhost.

Each configuration trains the demo's UNet (``fast`` recipe: DiceCE, Novograd, bf16 autocast where
this CPU gains from it) with DDP through ``monai_fast.apps.launch.run`` on in-memory patches, so
only compute and gradient all-reduce are timed. Per rank it also times the same step under
``no_sync()`` (compute alone) and one all-reduce of a gradient-sized buffer, the two numbers the
README's scaling model is built from. Ranks of several also time one all-reduce per buffer size of
``--sweep-mb``, the fastest of 9 (by default 1 kB, this UNet's gradient, 4 MB and SegResNet's 18.8 MB),
and a straight line through them gives the link's latency and bandwidth (:func:`fit_link`).

Configurations (the machine has ``os.cpu_count()`` cores), run in turns, round after round:
  1 rank x 1 thread   the single-"device" reference (one core, like one GPU)
  2 ranks x 1 thread  two "devices": the bar is >= 1.6x the reference (one torch.multiprocessing group)
  1 rank x all cores  the same machine used by one process (intra-op threads instead of ranks)
  2 nodes x 1 rank    two ``monai-fast launch --nnodes 2 --node-rank I --master-addr 127.0.0.1`` processes,
                      one rank each: torchrun's static rendezvous and TCP between two launcher trees, as
                      across nodes; on one host the bytes go through loopback, not a network

    python benchmarks/ddp_scaling.py                                  # about 3 minutes on 2 cores
    python benchmarks/ddp_scaling.py --tiny --steps 1 --repeats 1     # a toy run (32^3 patches)
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

CONFIGS = ("1x1", "2x1", "1xall", "nodes")
LABELS = {"1x1": "1 rank x 1 thr", "2x1": "2 ranks x 1 thr", "1xall": "1 rank x all thr", "nodes": "2 nodes x 1 rank"}
SEGRESNET_GRADIENT_BYTES = 4.70e6 * 4  # the guide's BraTS SegResNet, fp32
RING_MODEL = [  # (link, where the numbers come from, ranks, per-hop latency s, bus bandwidth bytes/s)
    ("NVLink", "assumed", 8, 5e-6, 100e9),
    ("InfiniBand 100 Gb/s", "assumed", 32, 5e-6, 10e9),
]


def _worker(
    local_rank: int, threads: int, steps: int, out: str, precision: str, tiny: bool, sweep_mb: list[float]
) -> None:
    from ignite import distributed as idist
    from monai.losses import DiceCELoss
    from monai.optimizers import Novograd

    from monai_fast.apps.recipes import RecipeConfig
    from monai_fast.apps.recipes.parts import build_network
    from monai_fast.distributed import detect
    from monai_fast.distributed.comm import allreduce_seconds
    from monai_fast.distributed.model import distribute
    from monai_fast.telemetry.precision import autocast_for

    torch.set_num_threads(threads)
    cfg = RecipeConfig(patch_size=(32, 32, 32) if tiny else (64, 64, 64)).with_defaults(
        batch_size=2, num_samples=4
    )  # 8 patches
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
        "launcher": detect().launcher,
        "node_rank": detect().node_rank,
        "sweep": [
            {"bytes": 4 * int(mb * 1e6 / 4), "s": allreduce_seconds(int(mb * 1e6 / 4), repeats=9, statistic=min)}
            for mb in sweep_mb
        ]
        if idist.get_world_size() > 1
        else [],
    }
    Path(out, f"rank{idist.get_rank()}.json").write_text(json.dumps(rec))


def _nodes_worker(args: argparse.Namespace) -> int:
    """One node's rank, under ``monai-fast launch`` (torchrun): the same timed step as every configuration."""
    from monai_fast.apps.launch import run

    run(_worker, args.threads, args.steps, args.node_worker, args.precision, args.tiny, args.sweep_mb, seed=0)
    return 0


def _run_nodes(threads: int, steps: int, out: str, precision: str, tiny: bool, sweep_mb: list[float]) -> None:
    from drill import run_local_nodes, static_nodes

    from monai_fast.apps.launch import free_port

    worker = [
        str(Path(__file__).resolve()),
        "--node-worker",
        out,
        "--threads",
        str(threads),
        "--steps",
        str(steps),
        "--precision",
        precision,
        "--sweep-mb",
        *map(str, sweep_mb),
        *(["--tiny"] if tiny else []),
    ]
    for rc, log in run_local_nodes(static_nodes(2, free_port()), worker, out, nproc=1):
        if rc != 0:
            raise SystemExit(f"ddp_scaling: a 2-node launcher failed (exit status {rc}):\n{log[-3000:]}")


def run_config(name: str, threads: int, steps: int, precision: str, tiny: bool, sweep_mb: list[float]) -> dict:
    """One configuration's measurement: ``name`` is one of :data:`CONFIGS`; the slowest rank's medians."""
    from monai_fast.apps.launch import run

    out = tempfile.mkdtemp()
    world = 1 if name in ("1x1", "1xall") else 2
    if name == "nodes":
        _run_nodes(threads, steps, out, precision, tiny, sweep_mb)
    else:
        run(
            _worker, threads, steps, out, precision, tiny, sweep_mb, nproc_per_node=world if world > 1 else None, seed=0
        )
    ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    if len(ranks) != world:
        raise SystemExit(f"ddp_scaling: {name}: {len(ranks)} of {world} ranks wrote their results into {out}")
    return {
        "config": name,
        "world": world,
        "threads_per_rank": threads,
        "samples_per_s": ranks[0]["samples_per_s"],
        "step_s": max(r["step_s_median"] for r in ranks),
        "compute_only_step_s": max(r["compute_only_step_s_median"] for r in ranks),
        "allreduce_s": max(r["allreduce_s_median"] for r in ranks),
        "gradient_mib": ranks[0]["gradient_mib"],
        "batch_per_rank": ranks[0]["batch_per_rank"],
        "launcher": ranks[0]["launcher"],
        "node_ranks": [r["node_rank"] for r in ranks],
        "sweep": [
            {"bytes": p["bytes"], "s": max(r["sweep"][i]["s"] for r in ranks)} for i, p in enumerate(ranks[0]["sweep"])
        ],
    }


def fit_link(sweep: list[dict], ranks: int = 2) -> dict:
    """Per-hop latency ``a`` and bus bandwidth ``B`` of a ring all-reduce, ``t = 2(N-1) a + 2(N-1)/N bytes / B``,
    from ``[{"bytes": ..., "s": ...}, ...]`` measured with ``ranks`` = N ranks.

    The line goes through the smallest buffer's point (1 kB by default: its time is nearly all latency)
    and takes its slope, ``1 / B``, from the others by least squares. An ordinary least-squares line
    would let the large buffers set the intercept too, and on loopback gloo (faster per byte for small
    buffers) that intercept comes out near zero or below.

    Example:
        >>> fit = fit_link(
        ...     [{"bytes": 1e3, "s": 2e-5 + 1e-7}, {"bytes": 1e9, "s": 0.1 + 2e-5}, {"bytes": 2e9, "s": 0.2 + 2e-5}]
        ... )
        >>> round(fit["latency_s"], 9), round(fit["bandwidth_bytes_s"] / 1e9, 3)
        (1e-05, 10.0)
    """
    points = sorted(sweep, key=lambda p: p["bytes"])
    scale = 2 * (ranks - 1) / ranks
    x0, y0 = scale * points[0]["bytes"], points[0]["s"]
    dx = [scale * p["bytes"] - x0 for p in points[1:]]
    slope = sum(d * (p["s"] - y0) for d, p in zip(dx, points[1:])) / sum(d * d for d in dx)
    if slope <= 0:
        raise ValueError(
            f"all-reduce times {[round(p['s'], 6) for p in points]} s do not grow with the buffer "
            f"({[p['bytes'] for p in points]} bytes): no bandwidth to fit; give --sweep-mb sizes further apart"
        )
    return {"latency_s": max(0.0, y0 - slope * x0) / (2 * (ranks - 1)), "bandwidth_bytes_s": 1 / slope, "points": sweep}


def ring_seconds(nbytes: float, ranks: int, latency_s: float, bandwidth: float) -> float:
    """One ring all-reduce of ``nbytes`` over ``ranks``: ``2(N-1) a + 2(N-1)/N bytes / B``."""
    return 2 * (ranks - 1) * latency_s + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def scaling_model(links: dict[str, dict], step_s: float) -> list[dict]:
    """The README's model: SegResNet's gradient all-reduced once a step, at 8 and 32 ranks, over each link.

    ``links`` maps a measured configuration to its :func:`fit_link`; :data:`RING_MODEL` adds the assumed
    GPU links. The speed-up ``N step / (step + all-reduce)`` counts no overlap with the backward pass.
    """
    rows = [
        {
            "link": f"gloo, {LABELS[name]} (loopback)",
            "source": "measured, N=2",
            "ranks": n,
            "latency_s": f["latency_s"],
            "bandwidth_bytes_s": f["bandwidth_bytes_s"],
        }
        for name, f in links.items()
        for n in (8, 32)
    ]
    rows += [
        {"link": link, "source": src, "ranks": n, "latency_s": a, "bandwidth_bytes_s": b}
        for link, src, n, a, b in RING_MODEL
    ]
    for r in rows:
        r["allreduce_s"] = ring_seconds(SEGRESNET_GRADIENT_BYTES, r["ranks"], r["latency_s"], r["bandwidth_bytes_s"])
        r["share_of_step"] = r["allreduce_s"] / step_s
        r["speedup"] = r["ranks"] * step_s / (step_s + r["allreduce_s"])
    return rows


def _print_results(med: dict[str, dict], fits: dict[str, dict], model: list[dict], step_s: float) -> None:
    ref = med["1x1"]["samples_per_s"] if "1x1" in med else float("nan")
    print(
        f"\n{'configuration':<18} {'samples/s':>10} {'vs 1x1':>7} {'step s':>8} {'compute s':>10} {'allreduce s':>12}"
    )
    for name, m in med.items():
        print(
            f"{LABELS[name]:<18} {m['samples_per_s']:>10.2f} {m['samples_per_s'] / ref:>6.2f}x "
            f"{m['step_s']:>8.3f} {m['compute_only_step_s']:>10.3f} {m['allreduce_s']:>12.4f}"
        )
    for name, f in fits.items():
        points = ", ".join(f"{p['bytes'] / 1e6:g} MB {1000 * p['s']:.2f} ms" for p in f["points"])
        print(
            f"all-reduce, {LABELS[name]} (2 ranks, gloo, loopback): {points}; fit a = {1e6 * f['latency_s']:.1f} us "
            f"per hop, B = {f['bandwidth_bytes_s'] / 1e9:.2f} GB/s"
        )
    print(
        f"\nmodel: {SEGRESNET_GRADIENT_BYTES / 1e6:.1f} MB SegResNet gradient once per step "
        f"of {step_s:.2f} s (assumed), "
        "no overlap with the backward pass"
    )
    print(
        f"{'link':<34} {'a, B from':<13} {'ranks':>5} {'a us':>6} {'B GB/s':>7} "
        f"{'all-reduce ms':>13} {'/ step':>8} {'speed-up':>9}"
    )
    for r in model:
        print(
            f"{r['link']:<34} {r['source']:<13} {r['ranks']:>5} {1e6 * r['latency_s']:>6.1f} "
            f"{r['bandwidth_bytes_s'] / 1e9:>7.2f} "
            f"{1000 * r['allreduce_s']:>13.2f} {100 * r['share_of_step']:>7.1f}% {r['speedup']:>8.1f}x"
        )


def _fits(rows: dict[str, list[dict]]) -> dict[str, dict]:
    """:func:`fit_link` per configuration of several ranks, on the median time per buffer size over the rounds."""
    fits = {}
    for name, runs in rows.items():
        if runs[0]["sweep"]:
            points = [
                {"bytes": p["bytes"], "s": statistics.median(r["sweep"][i]["s"] for r in runs)}
                for i, p in enumerate(runs[0]["sweep"])
            ]
            try:
                fits[name] = fit_link(points)
            except ValueError as e:  # a noisy sweep: the rest of the results still count
                print(f"{LABELS[name]}: {e}", flush=True)
    return fits


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="alternating rounds of all configurations")
    ap.add_argument(
        "--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="configurations to run (default all)"
    )
    ap.add_argument(
        "--sweep-mb",
        type=float,
        nargs="+",
        default=[0.001, 0.5, 4.0, 18.8],
        help="all-reduce buffer sizes (MB) timed by ranks of several, for the latency/bandwidth fit",
    )
    ap.add_argument("--model-step-s", type=float, default=0.3, help="the one-GPU step time the 8/32-GPU model assumes")
    ap.add_argument("--tiny", action="store_true", help="32^3 patches: a toy run")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--node-worker", help=argparse.SUPPRESS)  # set by the "nodes" configuration for its launched ranks
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="autocast precision of every configuration (default: auto, measured on this CPU)",
    )
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or len(args.sweep_mb) < 2 or min(args.sweep_mb) <= 0:
        ap.error(
            f"--steps {args.steps} and --repeats {args.repeats} must be >= 1, and --sweep-mb {args.sweep_mb} "
            "two or more sizes > 0"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    import os

    from monai_fast.files import write_json
    from monai_fast.telemetry import device_description
    from monai_fast.telemetry.precision import choose_precision

    args = _parse(argv)
    if args.node_worker:
        return _nodes_worker(args)
    cores = os.cpu_count() or 1
    precision = choose_precision(args.precision, "cpu")
    threads = {"1x1": 1, "2x1": max(1, cores // 2), "1xall": cores, "nodes": max(1, cores // 2)}
    rows: dict[str, list[dict]] = {c: [] for c in args.configs}
    for r in range(args.repeats):  # alternate so drift on a shared host hits every configuration alike
        for name in args.configs:
            res = run_config(name, threads[name], args.steps, precision, args.tiny, args.sweep_mb)
            rows[name].append(res)
            print(f"round {r + 1}: {LABELS[name]}: {res['samples_per_s']:.2f} samples/s", flush=True)
    med = {
        c: {k: statistics.median(x[k] for x in v) for k in v[0] if isinstance(v[0][k], (int, float))}
        for c, v in rows.items()
    }
    fits = _fits(rows)
    model = scaling_model(fits, args.model_step_s)
    _print_results(med, fits, model, args.model_step_s)
    ratios = {
        f"speedup_{c}_vs_1x1": med[c]["samples_per_s"] / med["1x1"]["samples_per_s"]
        for c in med
        if c != "1x1" and "1x1" in med
    }
    if "2x1" in med:
        two = med["2x1"]
        print(
            f"\n2 ranks vs 1 (equal per-rank batch {two['batch_per_rank']:.0f} patches, one core each): "
            f"{ratios.get('speedup_2x1_vs_1x1', float('nan')):.2f}x (bar >= 1.6x); "
            f"gradient {two['gradient_mib']:.2f} MiB, "
            f"all-reduce {1000 * two['allreduce_s']:.1f} ms = "
            f"{100 * two['allreduce_s'] / two['step_s']:.1f} % of a step"
        )
    if "2x1" in med and "nodes" in med:
        two, nodes = med["2x1"], med["nodes"]
        print(
            f"2 nodes x 1 rank (two launchers, torchrun's TCP rendezvous) vs 2 ranks in one group: "
            f"{nodes['samples_per_s'] / two['samples_per_s']:.2f}x the samples/s; gradient all-reduce "
            f"{1000 * nodes['allreduce_s']:.1f} ms vs {1000 * two['allreduce_s']:.1f} ms"
        )
    doc = {
        "benchmark": "ddp_scaling",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": device_description("cpu"),
        "precision": precision,
        "command": " ".join([sys.executable, *sys.argv]),
        "rounds": rows,
        "median": med,
        **ratios,
        "allreduce_fit": fits,
        "model_step_s_assumed": args.model_step_s,
        "model": model,
    }
    out = Path(args.out) / f"ddp_scaling_{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    write_json(doc, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
