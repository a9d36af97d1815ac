"""One CPU training step on a busy host: OpenMP threads left to the scheduler vs kept on separate cores.

Each run is a fresh process that times
``--steps`` training steps of a small UNet (bf16 autocast where the CPU has it, fp32 otherwise;
batch 2 of 64^3 patches, a fixed batch) with torch's default threads, printing wall and CPU seconds
per step. Variants, alternated within each repeat:

- ``free``: threads placed by the scheduler (``GOMP_SPINCOUNT=10000``, as ``monai-fast`` sets it);
- ``bound``: the same with ``OMP_PROC_BIND=spread OMP_PLACES=cores`` (one OpenMP thread per core);
- ``workers``: the team's worker threads pinned one per core, the main thread free
  (:func:`monai_fast.openmp.pin_openmp_workers`);
- ``iteration``: the workers pinned, and the main thread on the core they left free during each step
  (:func:`monai_fast.openmp.on_core`), what the ``monai-fast`` command does.

``loaded`` runs them with one busy-loop process per core for the whole run. On a 2-core host
(``docs/demo.md``, "OpenMP threads on a busy host") a process whose threads are not kept apart sometimes ran its
step at one core's worth of CPU time for the whole run (both threads sharing a core while the busy
processes had the other), several times slower than a bound one. ``OMP_PROC_BIND`` is not what the
command uses because a bound main thread passes its one-core mask to every thread and process it
starts (loader threads and workers) and the variables to every process it starts (ranks).

    python benchmarks/openmp_step_under_load.py --repeats 4          # about 6 min on 2 cores

Prints a table and writes ``openmp_step_under_load_<stamp>.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from busy import busy_cores

from monai_fast.files import write_json

STEP = """
import json, os, time, torch
from monai_fast.openmp import free_core, on_core, pin_openmp_workers
pinned = pin_openmp_workers() is not None if os.environ.get("STEP_PIN_WORKERS") in ("1", "main") else False
core = free_core() if os.environ.get("STEP_PIN_WORKERS") == "main" else None
from monai.networks.nets import UNet
from monai.losses import DiceCELoss
torch.manual_seed(0)
net = UNet(3, 1, 2, (8, 16, 32, 64), (2, 2, 2), num_res_units=1)
opt = torch.optim.AdamW(net.parameters(), 3e-3)
loss_f = DiceCELoss(to_onehot_y=True, softmax=True)
x = torch.randn(2, 1, 64, 64, 64)
y = (torch.rand(2, 1, 64, 64, 64) > 0.9).float()
bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
def step():
    with on_core(core):
        _step()
def _step():
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = loss_f(net(x), y)
    loss.backward()
    opt.step()
for _ in range(3):
    step()
c0, w0 = time.process_time(), time.perf_counter()
for _ in range({steps}):
    step()
print(json.dumps({{"wall_s": (time.perf_counter() - w0) / {steps}, "cpu_s": (time.process_time() - c0) / {steps},
                  "threads": torch.get_num_threads(), "bf16": bool(bf16), "pinned": pinned}}))
"""

VARIANTS = {
    "free": {},
    "bound": {"OMP_PROC_BIND": "spread", "OMP_PLACES": "cores"},
    "workers": {"STEP_PIN_WORKERS": "1"},
    "iteration": {"STEP_PIN_WORKERS": "main"},
}


def one_run(variant: str, steps: int) -> dict:
    """The step timed in a fresh process with ``variant``'s OpenMP settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "STEP_PIN_WORKERS")
    }
    env.update(GOMP_SPINCOUNT="10000", **VARIANTS[variant])
    proc = subprocess.run(
        [sys.executable, "-c", STEP.format(steps=steps)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the step failed ({variant}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=4, help="runs of each variant per condition (default %(default)s)")
    p.add_argument("--steps", type=int, default=16, help="timed steps per run (default %(default)s)")
    p.add_argument(
        "--spinners", type=int, default=os.cpu_count() or 1, help="busy processes while loaded (default: one per core)"
    )
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON (default %(default)s)")
    args = p.parse_args()
    runs = []
    for condition in ("quiet", "loaded"):
        with busy_cores(args.spinners if condition == "loaded" else 0):
            for rep in range(1, args.repeats + 1):
                for variant in VARIANTS:
                    r = {"condition": condition, "variant": variant, "repeat": rep, **one_run(variant, args.steps)}
                    runs.append(r)
                    print(
                        f"{condition} {variant} {rep}: {r['wall_s']:.3f} s wall, {r['cpu_s']:.3f} s CPU per step",
                        flush=True,
                    )
    head = ["condition", "variant", "runs", "wall s/step (each run)", "median", "CPU s/step median"]
    rows = []
    for condition in ("quiet", "loaded"):
        for variant in VARIANTS:
            mine = [r for r in runs if r["condition"] == condition and r["variant"] == variant]
            rows.append(
                [
                    condition,
                    variant,
                    str(len(mine)),
                    " ".join(f"{r['wall_s']:.2f}" for r in mine),
                    f"{statistics.median(r['wall_s'] for r in mine):.3f}",
                    f"{statistics.median(r['cpu_s'] for r in mine):.3f}",
                ]
            )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    for line in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    out = Path(args.out) / f"openmp_step_under_load_{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    write_json({"command": " ".join(sys.argv), "cpus": os.cpu_count(), "spinners": args.spinners, "runs": runs}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
