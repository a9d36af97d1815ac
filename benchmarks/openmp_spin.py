"""How long OpenMP threads spin before sleeping, and what it costs ``monai-fast demo`` on a quiet and a loaded host.

PyTorch's Linux wheels run their CPU kernels on GNU OpenMP (libgomp). Between parallel regions
its threads spin ``GOMP_SPINCOUNT`` rounds (libgomp's own default: 300000) before they sleep. When
other processes want the cores, a spinning thread burns the time slice its partner thread needs to
finish the region. ``monai-fast`` bounds the spin (:mod:`monai_fast.openmp`); this script measures
that choice: each run is the demo in a fresh process with ``GOMP_SPINCOUNT`` set to one of
``--spincounts``, quiet (the host as it is) and ``loaded`` (one busy-loop process per core for the
whole run), the variants alternating within each repeat. The spin count does not change what is
computed (how the work is split between threads does not depend on it), so every variant's Dice
curves must be equal; the script checks that and says so.

    python benchmarks/openmp_spin.py --repeats 2                      # quiet and loaded, 300000 vs 10000 (about 40 min)
    python benchmarks/openmp_spin.py --conditions quiet --repeats 2   # the quiet half (about 8 min)
    python benchmarks/openmp_spin.py --repeats 1 -- --cases 4 --shape 32 32 32 --patch-size 32 32 32 \\
        --channels 4 8 --max-epochs 2 --target 0.02                  # a toy run

Prints a table (per condition and spin count: medians of fast's time to target, both recipes' seconds
per epoch interleaved and their ratio) and writes ``openmp_spin_<stamp>.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from busy import busy_cores

from monai_fast.files import write_json


def one_run(condition: str, spincount: int, spinners: int, run_dir: Path, demo_args: list[str]) -> dict:
    """The demo once in a fresh process with ``GOMP_SPINCOUNT=spincount``; its figures and Dice curves."""
    env = {**os.environ, "GOMP_SPINCOUNT": str(spincount)}
    t0 = time.perf_counter()
    with busy_cores(spinners if condition == "loaded" else 0):
        proc = subprocess.run(
            [sys.executable, "-m", "monai_fast", "demo", "--no-progress", "--run-dir", str(run_dir), *demo_args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if proc.returncode != 0:
        raise SystemExit(
            f"the demo failed (exit {proc.returncode}, GOMP_SPINCOUNT={spincount}):\n{proc.stdout[-3000:]}"
            f"{proc.stderr[-3000:]}"
        )
    doc = json.loads((run_dir / "results.json").read_text())
    recipes = doc["headline"]["recipes"]
    fast, base = recipes["fast"], recipes["baseline"]
    curves = {r["recipe"]: [e["val_dice"] for e in r["epochs"]] for r in doc["results"]}
    return {
        "condition": condition,
        "spincount": spincount,
        "wall_s": time.perf_counter() - t0,
        "fast_time_to_target_s": fast["time_to_target_s"]["value"],
        "fast_s_per_epoch": fast["s_per_epoch_interleaved"],
        "baseline_s_per_epoch": base["s_per_epoch_interleaved"],
        "per_epoch_ratio": base["s_per_epoch_interleaved"] / fast["s_per_epoch_interleaved"],
        "fast_cpu_s_per_epoch": fast["cpu_s_per_epoch_interleaved"],
        "baseline_cpu_s_per_epoch": base["cpu_s_per_epoch_interleaved"],
        "others_cpu_share": (doc["headline"].get("host") or {}).get("others_cpu_share"),
        "curves": curves,
    }


def _median(values: list[float | None]) -> float | None:
    """The median of the values that exist (``None``: fast missed the target in that run); ``None`` if none do."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def summarize(runs: list[dict]) -> list[dict]:
    """Per condition and spin count: the medians of the runs' figures."""
    rows = []
    for condition in dict.fromkeys(r["condition"] for r in runs):
        for spincount in dict.fromkeys(r["spincount"] for r in runs):
            mine = [r for r in runs if r["condition"] == condition and r["spincount"] == spincount]
            if mine:
                rows.append(
                    {
                        "condition": condition,
                        "spincount": spincount,
                        "runs": len(mine),
                        **{
                            k: _median([r[k] for r in mine])
                            for k in (
                                "fast_time_to_target_s",
                                "fast_s_per_epoch",
                                "baseline_s_per_epoch",
                                "per_epoch_ratio",
                                "fast_cpu_s_per_epoch",
                                "baseline_cpu_s_per_epoch",
                            )
                        },
                    }
                )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--spincounts",
        type=int,
        nargs="+",
        default=[300000, 10000],
        help="GOMP_SPINCOUNT values, alternated (default: libgomp's own 300000, and 10000)",
    )
    p.add_argument("--conditions", nargs="+", choices=["quiet", "loaded"], default=["quiet", "loaded"])
    p.add_argument("--repeats", type=int, default=2, help="runs of each variant per condition (default %(default)s)")
    p.add_argument(
        "--spinners", type=int, default=os.cpu_count() or 1, help="busy processes while loaded (default: one per core)"
    )
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON (default %(default)s)")
    p.add_argument(
        "demo_args", nargs="*", help="options passed to monai-fast demo (after --; default --epoch-multiple 1)"
    )
    args = p.parse_args()
    demo_args = args.demo_args or ["--epoch-multiple", "1"]
    runs = []
    with tempfile.TemporaryDirectory(prefix="openmp_spin-") as tmp:
        for condition in args.conditions:
            for rep in range(1, args.repeats + 1):
                for spincount in args.spincounts:
                    r = one_run(
                        condition, spincount, args.spinners, Path(tmp) / f"{condition}-{spincount}-{rep}", demo_args
                    )
                    runs.append({"repeat": rep, **r})
                    print(
                        f"{condition} GOMP_SPINCOUNT={spincount} repeat {rep}: fast "
                        f"{_cell(r['fast_time_to_target_s'], '.1f')} s to target, "
                        f"s/epoch fast {r['fast_s_per_epoch']:.2f} baseline {r['baseline_s_per_epoch']:.2f} "
                        f"(ratio {r['per_epoch_ratio']:.2f}x)",
                        flush=True,
                    )
    same = all(r["curves"] == runs[0]["curves"] for r in runs)
    rows = summarize(runs)
    head = [
        "condition",
        "GOMP_SPINCOUNT",
        "runs",
        "fast to target s",
        "fast s/epoch",
        "baseline s/epoch",
        "per-epoch ratio",
        "fast CPU s/epoch",
        "baseline CPU s/epoch",
    ]
    cells = [
        [
            r["condition"],
            str(r["spincount"]),
            str(r["runs"]),
            _cell(r["fast_time_to_target_s"], ".1f"),
            _cell(r["fast_s_per_epoch"], ".2f"),
            _cell(r["baseline_s_per_epoch"], ".2f"),
            _cell(r["per_epoch_ratio"], ".2f") + "x",
            _cell(r["fast_cpu_s_per_epoch"], ".1f"),
            _cell(r["baseline_cpu_s_per_epoch"], ".1f"),
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    for line in [head, ["-" * w for w in widths], *cells]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    print(f"Dice curves equal in every run: {same}")
    out = Path(args.out) / f"openmp_spin_{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    write_json(
        {
            "command": " ".join(sys.argv),
            "cpus": os.cpu_count(),
            "spinners": args.spinners,
            "demo_args": demo_args,
            "curves_equal": same,
            "summary": rows,
            "runs": runs,
        },
        out,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
