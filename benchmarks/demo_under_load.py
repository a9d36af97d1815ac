"""Does the demo's headline hold on a loaded host? ``monai-fast demo`` run quiet and under load, alternating.

Each pair runs the demo once as the host is (``quiet``) and once with ``--spinners`` busy-loop
processes (one per core by default: a competing CPU job) running for the whole demo
(``loaded``). Each run's captured output and ``results.json`` are kept; the summary has every
run's headline (speed-up, measured or estimated, and its clock: older results may hold the CPU
seconds' figure there; ``--recompute`` rebuilds it), both speed-ups and both per-epoch ratios (wall
and CPU seconds), fast's epochs and time to target, the
baseline's epochs run and estimated epochs to target, both seconds per epoch and the host's load
average, and the spread: largest over smallest headline, minus 1. ``--recompute FOLDER`` rebuilds
every run's headline from its saved ``results.json`` with this checkout's
:func:`~monai_fast.apps.demo.headline.headline` (same epochs, same budget) and writes
``summary_recomputed.json``. Other users of a shared
machine are not stopped: ``quiet`` is the host as it is, and its load average is recorded.

    python benchmarks/demo_under_load.py --pairs 2                       # the real numbers (about 40 min on 2 cores)
    python benchmarks/demo_under_load.py --recompute benchmarks/results/demo_under_load_<stamp>   # headlines again
    python benchmarks/demo_under_load.py --pairs 1 -- --cases 4 --shape 32 32 32 --patch-size 32 32 32 \\
        --channels 4 8 --max-epochs 4 --target 0.02                     # a toy run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from busy import busy_cores

from monai_fast.apps.demo.headline import format_headline, headline
from monai_fast.apps.training.run import EpochRow, TrainResult
from monai_fast.files import write_json


def figures(head: dict) -> dict:
    """The summary's figures of one headline (:func:`monai_fast.apps.demo.headline.headline`'s document)."""
    fast, base = head["recipes"]["fast"], head["recipes"]["baseline"]
    return {
        "speedup": head["speedup"]["factor"],
        "how": head["speedup"]["how"],
        "clock": head["speedup"].get("clock", "wall"),
        "wall_speedup": head["speedup"].get("wall_factor", head["speedup"]["factor"]),
        "cpu_speedup": head["speedup"].get("cpu_factor"),
        "per_epoch_ratio": base["s_per_epoch_interleaved"] / fast["s_per_epoch_interleaved"],
        "cpu_per_epoch_ratio": (
            base["cpu_s_per_epoch_interleaved"] / fast["cpu_s_per_epoch_interleaved"]
            if base.get("cpu_s_per_epoch_interleaved") and fast.get("cpu_s_per_epoch_interleaved")
            else None
        ),
        "fast_epochs_to_target": fast["epochs_to_target"]["value"],
        "fast_time_to_target_s": fast["time_to_target_s"]["value"],
        "fast_s_per_epoch": fast["s_per_epoch_interleaved"],
        "baseline_s_per_epoch": base["s_per_epoch_interleaved"],
        "fast_cpu_s_per_epoch": fast.get("cpu_s_per_epoch_interleaved"),
        "baseline_cpu_s_per_epoch": base.get("cpu_s_per_epoch_interleaved"),
        "baseline_epochs_run": base["epochs_run"],
        "baseline_best_dice": base["best_dice"],
        "baseline_stopped": base["stopped"],
        "baseline_epochs_to_target": base["epochs_to_target"],
        "budget": head["budget"],
        "others_cpu_share": (head.get("host") or {}).get("others_cpu_share"),
    }


def recompute(folder: Path) -> None:
    """Each run's headline rebuilt from its ``results.json`` with this checkout's code; printed and summarized."""
    old = json.loads((folder / "summary.json").read_text())
    runs = []
    for run in old["runs"]:
        doc = json.loads((folder / f"{run['name']}.results.json").read_text())
        results = [TrainResult(**{**r, "epochs": [EpochRow(**e) for e in r["epochs"]]}) for r in doc["results"]]
        paired = {name: e["epochs_interleaved"] for name, e in doc["headline"]["recipes"].items()}
        head = headline(results, paired, doc["headline"]["budget"], host=doc["headline"].get("host"))
        print(f"== {run['name']}\n{format_headline(head)}")
        runs.append(
            {**run, **figures(head), "as_run": {k: run[k] for k in ("speedup", "how", "baseline_epochs_to_target")}}
        )
    factors = [r["speedup"] for r in runs if r["speedup"]]
    spread = max(factors) / min(factors) - 1 if len(factors) == len(runs) else None
    write_json(
        {**old, "runs": runs, "spread": spread, "recomputed_with": "this checkout's headline()"},
        folder / "summary_recomputed.json",
    )
    print(f"spread (largest / smallest headline - 1): {'n/a' if spread is None else f'{100 * spread:.0f}%'}")


def one_run(condition: str, spinners: int, run_dir: Path, log: Path, demo_args: list[str]) -> dict:
    """Run the demo once (with ``spinners`` busy processes when ``condition`` is ``loaded``); its headline in
    figures."""
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    with busy_cores(spinners if condition == "loaded" else 0), open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "monai_fast", "demo", "--no-progress", "--run-dir", str(run_dir), *demo_args],
            stdout=f,
            stderr=subprocess.STDOUT,
            check=False,
        ).returncode
    if rc != 0:
        raise SystemExit(f"the demo failed (exit {rc}); see {log}")
    head = json.loads((run_dir / "results.json").read_text())["headline"]
    return {
        "condition": condition,
        "wall_s": time.perf_counter() - t0,
        "load_avg_1min_at_start": load_before,
        "load_avg_1min_at_end": os.getloadavg()[0],
        **figures(head),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2, help="quiet/loaded pairs (default %(default)s)")
    p.add_argument(
        "--spinners", type=int, default=os.cpu_count() or 1, help="busy processes while loaded (default: one per core)"
    )
    p.add_argument("--out", default="benchmarks/results", help="folder for the results folder (default %(default)s)")
    p.add_argument("--recompute", type=Path, help="rebuild the headlines of this earlier results folder and stop")
    p.add_argument("demo_args", nargs="*", help="options passed to monai-fast demo (after --)")
    args = p.parse_args()
    if args.recompute is not None:
        recompute(args.recompute)
        return
    folder = Path(args.out) / f"demo_under_load_{dt.datetime.now():%Y%m%d-%H%M%S}"
    folder.mkdir(parents=True)
    runs = []
    for i in range(1, args.pairs + 1):
        for condition in ("quiet", "loaded"):
            name = f"{condition}{i}"
            run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"{folder.name}-{name}"
            runs.append(
                {"name": name, **one_run(condition, args.spinners, run_dir, folder / f"{name}.log", args.demo_args)}
            )
            shutil.copy(run_dir / "results.json", folder / f"{name}.results.json")
            r = runs[-1]
            cpu_ratio = "-" if r["cpu_per_epoch_ratio"] is None else f"{r['cpu_per_epoch_ratio']:.2f}x"
            print(
                f"{name}: {r['speedup'] or 0:.1f}x ({r['how']}, {r['clock']} clock), "
                f"per epoch {r['per_epoch_ratio']:.2f}x wall, "
                f"{cpu_ratio} CPU, fast "
                f"{r['fast_epochs_to_target']} epochs {r['fast_time_to_target_s'] or 0:.1f} s, "
                f"baseline {r['baseline_epochs_run']} "
                f"epochs ({r['baseline_stopped']}), load {r['load_avg_1min_at_start']:.1f}, other processes' CPU share "
                f"{'-' if r['others_cpu_share'] is None else format(r['others_cpu_share'], '.0%')}",
                flush=True,
            )
    factors = [r["speedup"] for r in runs if r["speedup"]]
    spread = max(factors) / min(factors) - 1 if len(factors) == len(runs) else None
    write_json(
        {
            "command": " ".join(sys.argv),
            "spinners": args.spinners,
            "cpus": os.cpu_count(),
            "runs": runs,
            "spread": spread,
        },
        folder / "summary.json",
    )
    print(
        "spread (largest / smallest headline - 1): "
        f"{'n/a' if spread is None else f'{100 * spread:.0f}%'}; wrote {folder}"
    )


if __name__ == "__main__":
    main()
