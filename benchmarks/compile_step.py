"""Does ``torch.compile`` make the user's training step faster? Eager vs compiled, each in its own process.

The network is ``your_trainer.py``'s (MONAI's 3D ``UNet`` as the spleen tutorial builds it: batch
norm, 2 residual units), with its loss (``DiceLoss``) and optimizer (``Adam``). Each variant runs in
a fresh process (a compiled graph, and inductor's in-memory caches, do not leak into the other),
the variants take turns repeat by repeat, and each process times ``--steps`` training steps after
one warm-up step (the compile, for ``compile``) and the sliding window's forward pass (a batch of
``--sw-batch`` windows, in eval mode, no grad) likewise. The table gives per variant the median step,
the first step (compiling included) and the ratio eager / compiled, measured within each repeat;
the JSON keeps every step. ``--precision bf16`` runs the step under CPU autocast; use it only
where the CPU has bf16 hardware.

    python benchmarks/compile_step.py                             # about 3 minutes on 2 CPU cores
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/compile_step.py   # a CPU without bf16
    python benchmarks/compile_step.py --patch 16 16 16 --channels 4 8 --batch 2 --steps 2 --repeats 1   # a toy run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("eager", "compile")


def one_process(args: argparse.Namespace) -> dict:
    """Time the step and the window forward in this process for ``args.variant``; returns the timings."""
    import torch
    from monai.losses import DiceLoss
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    net = UNet(
        spatial_dims=3,
        in_channels=1,
        out_channels=2,
        channels=tuple(args.channels),
        strides=(2,) * (len(args.channels) - 1),
        num_res_units=2,
        norm="batch",
    )
    optimizer = torch.optim.Adam(net.parameters(), 1e-4)
    loss_fn = DiceLoss(to_onehot_y=True, softmax=True)
    model = torch.compile(net) if args.variant == "compile" else net
    x = torch.rand(args.batch, 1, *args.patch)
    y = (torch.rand(args.batch, 1, *args.patch) > 0.5).float()
    bf16 = args.precision == "bf16"

    def step() -> float:
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            out = model(x)
        loss = loss_fn(out.float(), y)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - t

    train = [step() for _ in range(args.steps + 1)]
    net.eval()
    windows = torch.rand(args.sw_batch, 1, *args.patch)

    def forward() -> float:
        t = time.perf_counter()
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            model(windows)
        return time.perf_counter() - t

    window = [forward() for _ in range(args.steps + 1)]
    return {
        "variant": args.variant,
        "train_first_s": train[0],
        "train_s": train[1:],
        "window_first_s": window[0],
        "window_s": window[1:],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--patch", type=int, nargs=3, default=(64, 64, 64), help="crop size (default 64 64 64)")
    p.add_argument(
        "--channels", type=int, nargs="+", default=(8, 16, 32, 64), help="UNet channels (default 8 16 32 64)"
    )
    p.add_argument("--batch", type=int, default=8, help="crops per step (default 8: batch 2 x 4 crops)")
    p.add_argument("--sw-batch", type=int, default=4, help="windows per forward pass (default 4)")
    p.add_argument("--steps", type=int, default=6, help="timed steps after the first (default 6)")
    p.add_argument("--repeats", type=int, default=2, help="processes per variant, taking turns (default 2)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="default fp32")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measuring process
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1")
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        p.error("torch.compile's CPU kernels need a C++ compiler (g++ or clang++) on the PATH")
    if args.variant is not None:
        print(json.dumps(one_process(args)))
        return 0
    base = [
        sys.executable,
        __file__,
        "--patch",
        *map(str, args.patch),
        "--channels",
        *map(str, args.channels),
        "--batch",
        str(args.batch),
        "--sw-batch",
        str(args.sw_batch),
        "--steps",
        str(args.steps),
        "--precision",
        args.precision,
    ]
    runs = []
    for r in range(1, args.repeats + 1):
        for variant in VARIANTS:
            print(f"-- repeat {r}: {variant}", flush=True)
            out = subprocess.run([*base, "--variant", variant], capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"compile_step: the {variant} process failed (exit {out.returncode})")
            runs.append({"repeat": r, **json.loads(out.stdout.strip().splitlines()[-1])})
    rows = []
    for r in range(1, args.repeats + 1):
        got = {x["variant"]: x for x in runs if x["repeat"] == r}
        e, c = got["eager"], got["compile"]
        rows.append(
            {
                "repeat": r,
                **{f"{v}_{k}": statistics.median(got[v][f"{k}_s"]) for v in VARIANTS for k in ("train", "window")},
                "compile_first_s": c["train_first_s"],
                "compile_window_first_s": c["window_first_s"],
                "train_ratio": statistics.median(e["train_s"]) / statistics.median(c["train_s"]),
                "window_ratio": statistics.median(e["window_s"]) / statistics.median(c["window_s"]),
            }
        )
    print(
        f"\n{'repeat':<7}{'eager step s':>13}{'compiled s':>12}{'ratio':>8}{'first compiled s':>18}"
        f"{'eager window s':>16}{'compiled s':>12}{'ratio':>8}"
    )
    for row in rows:
        print(
            f"{row['repeat']:<7}{row['eager_train']:>13.3f}{row['compile_train']:>12.3f}{row['train_ratio']:>7.2f}x"
            f"{row['compile_first_s']:>18.1f}{row['eager_window']:>16.3f}{row['compile_window']:>12.3f}{row['window_ratio']:>7.2f}x"
        )
    isa = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ}
    doc = {
        "benchmark": "compile_step",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "isa_limits": isa,
            "threads": runs[0]["threads"],
            "torch": runs[0]["torch"],
            "python": sys.version.split()[0],
        },
        "options": {k: v for k, v in vars(args).items() if k != "variant"},
        "rows": rows,
        "runs": runs,
        "median_train_ratio": statistics.median(r["train_ratio"] for r in rows),
        "median_window_ratio": statistics.median(r["window_ratio"] for r in rows),
    }
    from monai_fast.files import write_json

    path = write_json(doc, Path(args.out) / f"compile_step_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(
        f"median eager / compiled: step {doc['median_train_ratio']:.2f}x, window {doc['median_window_ratio']:.2f}x"
        f"{' (ISA limited: ' + str(isa) + ')' if isa else ''}; results: {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
