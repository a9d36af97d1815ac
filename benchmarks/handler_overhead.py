"""Overhead of monai-fast's telemetry handlers: NVTX + GPUSampler + TimeBreakdown + ThroughputMonitor.

Two measurements, in the same run:

1. **Handler cost per iteration** (precise): an ignite ``Engine`` whose step does nothing runs
   N iterations bare and with all four handlers (plus the run record); the difference per
   iteration is what the handlers add, in microseconds. Divided by the iteration time of the
   demo's real MONAI trainer (measured here too) it gives the overhead share.
2. **A/B on the real trainer** (noisy): the same MONAI ``SupervisedTrainer`` set-up runs
   alternately bare and with the handlers, ``--rounds`` times; the ratio of median round times.
   On a shared machine this ratio scatters by a few percent, so (1) is the figure to
   hold against the 1 % bar and (2) is the sanity check.

On a machine without NVML the GPUSampler uses the fake NVML backend, so its thread and its rows
still cost what they cost; on a GPU the real NVML backend is used. Prints a table and writes
``benchmarks/results/handler_overhead_<time>.json``.

    python benchmarks/handler_overhead.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from ignite.engine import Engine
from monai.engines import SupervisedTrainer
from monai.losses import DiceCELoss
from monai.networks.layers import Norm
from monai.networks.nets import UNet
from monai.optimizers import Novograd

from monai_fast.files import write_json
from monai_fast.handlers import GPUSampler, NVTXHandler, RecordHandler, ThroughputMonitor, TimeBreakdown
from monai_fast.telemetry import cuda_available, device_description
from monai_fast.telemetry.nvml import FakeNvml, NvmlUnavailable, open_nvml


def attach_all(engine: Engine, run_dir: Path, nvml) -> None:
    RecordHandler(run_dir).attach(engine)
    NVTXHandler().attach(engine)
    GPUSampler(interval_s=0.5, backend=nvml, gpus=[0]).attach(engine)
    TimeBreakdown().attach(engine)
    ThroughputMonitor(log_every_epoch=False).attach(engine)


def nvml_backend():
    try:
        return open_nvml(), "nvml"
    except NvmlUnavailable:
        return FakeNvml(), "fake-nvml"


def handler_cost_us(iterations: int, repeats: int, tmp: Path) -> tuple[float, float, float]:
    batch = {"image": torch.zeros(8, 1, 4, 4, 4), "label": torch.zeros(8, 1, 4, 4, 4)}
    data = [batch] * iterations
    bare, full = [], []
    for r in range(repeats):
        e = Engine(lambda e, b: None)
        t = time.perf_counter()
        e.run(data, max_epochs=1)
        bare.append((time.perf_counter() - t) / iterations)
        e = Engine(lambda e, b: None)
        nvml, _ = nvml_backend()
        attach_all(e, tmp / f"noop{r}", nvml)
        t = time.perf_counter()
        e.run(data, max_epochs=1)
        full.append((time.perf_counter() - t) / iterations)
    b, f = statistics.median(bare) * 1e6, statistics.median(full) * 1e6
    return b, f, f - b


def make_trainer(device: torch.device, batch: dict, iterations: int) -> SupervisedTrainer:
    torch.manual_seed(0)
    net = UNet(3, 1, 2, channels=(8, 16, 32, 64), strides=(2, 2, 2), num_res_units=1, norm=Norm.BATCH).to(device)
    return SupervisedTrainer(
        device=device,
        max_epochs=1,
        train_data_loader=[batch] * iterations,
        network=net,
        optimizer=Novograd(net.parameters(), 2e-3),
        loss_function=DiceCELoss(to_onehot_y=True, softmax=True),
        amp=device.type == "cuda",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="A/B rounds on the real trainer (default %(default)s)")
    p.add_argument("--iterations", type=int, default=8, help="trainer iterations per round (default %(default)s)")
    p.add_argument(
        "--noop-iterations", type=int, default=5000, help="iterations of the no-op engine (default %(default)s)"
    )
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON (default %(default)s)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("monai_fast").setLevel(logging.ERROR)  # the no-op engine is all "data wait" by design
    device = torch.device("cuda" if cuda_available() else "cpu")
    _, nvml_kind = nvml_backend()

    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        bare_us, full_us, cost_us = handler_cost_us(args.noop_iterations, 5, tmp)

        shape = (8, 1, 64, 64, 64)
        batch = {"image": torch.randn(shape), "label": (torch.rand(shape) > 0.9).float()}
        rounds_bare, rounds_full = [], []
        warm = make_trainer(device, batch, 2)
        warm.run()
        for r in range(args.rounds):
            for with_handlers in (False, True) if r % 2 == 0 else (True, False):
                trainer = make_trainer(device, batch, args.iterations)
                if with_handlers:
                    nvml, _ = nvml_backend()
                    attach_all(trainer, tmp / f"real{r}", nvml)
                t = time.perf_counter()
                trainer.run()
                per_iter = (time.perf_counter() - t) / args.iterations
                (rounds_full if with_handlers else rounds_bare).append(per_iter)

    iter_s = statistics.median(rounds_bare)
    ab = statistics.median(rounds_full) / iter_s - 1.0
    share = cost_us * 1e-6 / iter_s
    rows = [
        ("no-op engine, bare (us/iteration)", f"{bare_us:.1f}"),
        ("no-op engine, all handlers (us/iteration)", f"{full_us:.1f}"),
        ("handler cost (us/iteration)", f"{cost_us:.1f}"),
        ("demo trainer iteration, bare (s)", f"{iter_s:.3f}"),
        ("handler cost / trainer iteration", f"{100 * share:.3f}%"),
        (f"A/B median ratio - 1 ({args.rounds} rounds, noisy)", f"{100 * ab:+.2f}%"),
        ("bar: < 1 %", "met" if share < 0.01 else "NOT met"),
    ]
    w = max(len(k) for k, _ in rows)
    print(f"handler overhead on {device_description(device)} (GPUSampler backend: {nvml_kind})")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    doc = {
        "benchmark": "handler_overhead",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {"device": device_description(device), "platform": platform.platform()},
        "gpu_sampler_backend": nvml_kind,
        "handlers": ["RecordHandler", "NVTXHandler", "GPUSampler", "TimeBreakdown", "ThroughputMonitor"],
        "noop_us_per_iteration": {"bare": bare_us, "all_handlers": full_us, "cost": cost_us},
        "trainer": {
            "batch_shape": list(shape),
            "iteration_s_bare": iter_s,
            "rounds_bare_s": rounds_bare,
            "rounds_full_s": rounds_full,
        },
        "overhead_share": share,
        "ab_ratio_minus_1": ab,
        "bar_met": share < 0.01,
    }
    path = write_json(doc, Path(args.out) / f"handler_overhead_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
