"""A MONAI bundle as published against ``monai-fast bundle run``: per-epoch time, final Dice, the levers applied.

Each run is its own process on its own copy of the bundle (so the two variants share no cache, no process state
and no output folder), with the same overrides and seed; the variants take turns (published, fast, published,
fast, ...) so that a slow spell of a shared machine hits both. The per-epoch time is read from each run's record:
the training epoch's data wait and compute (``TimeBreakdown``'s epoch rows) plus the validation spans that ended in
that epoch. The first epoch is reported apart (it carries cache filling and FastTraining's measurements); the
per-epoch figure is the median of the epochs after it (the first alone when there is one epoch); the whole run is
the run's wall clock from loading the bundle to its end (compiling, when FastTraining compiles, included). Ratios
are published over fast, pair by pair. The final validation metric is the evaluator's (``BundleResult.metrics``).

    python benchmarks/bundle.py --bundle /path/to/spleen_ct_segmentation --repeats 2 --epochs 3 \\
        dataset_dir=/data/Task09_Spleen "device=\\$torch.device('cpu')"
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
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from monai_fast.files import write_json
from monai_fast.telemetry import device_description
from monai_fast.telemetry.precision import cpu_has_bf16_hardware

ROOT = Path(__file__).resolve().parents[1]


__all__ = ["epoch_times", "main", "run_variant", "summarise"]

VARIANTS = ("published", "fast")


def epoch_times(rows: Sequence[dict]) -> list[dict[str, float]]:
    """Per training epoch: ``train_s`` (data wait + compute), ``validation_s`` and their sum ``epoch_s``.

    A validation span counts in the epoch whose ``TimeBreakdown`` row follows its end (the bundle's
    ``ValidationHandler`` runs at the end of the training epoch, before the row is written).
    """
    epochs = sorted(
        (
            r
            for r in rows
            if r.get("kind") == "epoch" and r.get("source") == "time_breakdown" and r.get("engine") == "train"
        ),
        key=lambda r: r["time"],
    )
    spans = [r for r in rows if r.get("kind") == "span" and r.get("category") == "validation"]
    out = []
    previous = float("-inf")
    for e in epochs:
        val = sum(s["duration_s"] for s in spans if previous < s["end"] <= e["time"])
        train = float(e["data_s"]) + float(e["compute_s"])
        out.append(
            {
                "epoch": int(e["epoch"]),
                "train_s": round(train, 4),
                "validation_s": round(val, 4),
                "epoch_s": round(train + val, 4),
            }
        )
        previous = e["time"]
    return out


def _per_epoch(epochs: Sequence[dict]) -> float | None:
    later = [e["epoch_s"] for e in epochs[1:]] or [e["epoch_s"] for e in epochs[:1]]
    return round(statistics.median(later), 4) if later else None


def _dice(metrics: dict[str, float]) -> tuple[str | None, float | None]:
    names = [k for k in metrics if k.startswith("validate/") and k != "validate/best"]
    pick = next((k for k in names if "dice" in k.lower()), names[0] if names else None)
    return pick, (metrics[pick] if pick else None)


def _child(args: argparse.Namespace) -> int:
    """One run in this process: the bundle copy is ``args.bundle``; the result goes to ``args.child`` as JSON."""
    from monai_fast.bundle import parse_overrides, run_bundle
    from monai_fast.telemetry.record import load_record

    overrides = parse_overrides(args.overrides)
    start = time.perf_counter()
    result = run_bundle(
        args.bundle,
        config_files=args.config_file,
        overrides=overrides,
        fast=args.variant == "fast",
        logging_file=False,
        run_dir=args.run_dir,
        doctor=False,
    )
    wall = time.perf_counter() - start
    rows, _ = load_record(result.run_dir)
    doc = {
        "variant": args.variant,
        "wall_s": round(wall, 3),
        "applied": result.applied,
        "metrics": result.metrics,
        "epochs": epoch_times(rows),
    }
    Path(args.child).write_text(json.dumps(doc))
    return 0


def run_variant(
    bundle: Path, variant: str, overrides: Sequence[str], config_file: str | None, work: Path, timeout: float
) -> dict[str, Any]:
    """One run of ``bundle`` (``published`` or ``fast``) in its own process on its own copy; its result document.

    Raises:
        SystemExit: the run failed or passed ``timeout``, with its output's tail.
    """
    copy = work / f"{variant}-{time.monotonic_ns()}"
    shutil.copytree(bundle, copy, ignore=shutil.ignore_patterns("eval", "runs"))
    out = copy / "bench_result.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--bundle",
        str(copy),
        "--variant",
        variant,
        "--child",
        str(out),
        "--run-dir",
        str(copy / "record"),
    ]
    if config_file:
        cmd += ["--config_file", config_file]
    cmd += list(overrides)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        r = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as err:
        raise SystemExit(f"bundle bench: the {variant} run of {bundle} passed the {timeout:.0f} s limit") from err
    if r.returncode != 0 or not out.is_file():
        tail = (r.stdout[-1500:] + r.stderr[-3000:]).strip()
        raise SystemExit(f"bundle bench: the {variant} run of {bundle} failed (exit {r.returncode}):\n{tail}")
    doc = json.loads(out.read_text())
    shutil.rmtree(copy, ignore_errors=True)
    return doc


def summarise(runs: Sequence[dict]) -> dict[str, Any]:
    """Pairs (published, fast) in run order with their per-epoch ratio, and the medians over pairs."""
    pairs = []
    for i in range(0, len(runs) - 1, 2):
        a, b = runs[i], runs[i + 1]
        pa, pb = _per_epoch(a["epochs"]), _per_epoch(b["epochs"])
        pairs.append(
            {
                "repeat": i // 2 + 1,
                "published_s": pa,
                "fast_s": pb,
                "ratio": round(pa / pb, 4) if pa and pb else None,
                "published_run_s": a["wall_s"],
                "fast_run_s": b["wall_s"],
                "run_ratio": round(a["wall_s"] / b["wall_s"], 4) if a["wall_s"] and b["wall_s"] else None,
                "published_first_epoch_s": a["epochs"][0]["epoch_s"] if a["epochs"] else None,
                "fast_first_epoch_s": b["epochs"][0]["epoch_s"] if b["epochs"] else None,
                "published_metric": _dice(a["metrics"])[1],
                "fast_metric": _dice(b["metrics"])[1],
            }
        )
    ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
    runs_ = [p["run_ratio"] for p in pairs if p["run_ratio"] is not None]
    return {
        "pairs": pairs,
        "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
        "median_run_ratio": round(statistics.median(runs_), 4) if runs_ else None,
    }


def _table(doc: dict) -> str:
    lines = [
        f"bundle {doc['bundle']}: {doc['epochs']} epoch(s), {doc['repeats']} repeat(s), metric {doc['metric']}",
        "| repeat | published s/epoch | fast s/epoch | ratio | first epoch published / fast s "
        "| whole run published / fast s | run ratio | metric published | metric fast |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    for p in doc["summary"]["pairs"]:
        lines.append(
            f"| {p['repeat']} | {f(p['published_s'])} | {f(p['fast_s'])} | {f(p['ratio'])} | "
            f"{f(p['published_first_epoch_s'])} / {f(p['fast_first_epoch_s'])} | "
            f"{f(p.get('published_run_s'))} / {f(p.get('fast_run_s'))} | {f(p.get('run_ratio'))} | "
            f"{f(p['published_metric'])} | {f(p['fast_metric'])} |"
        )
    lines.append(
        f"median ratio (published / fast): per epoch {f(doc['summary']['median_ratio'])}, "
        f"whole run {f(doc['summary'].get('median_run_ratio'))}"
    )
    lines.append("levers applied: " + (", ".join(f"{k}: {v}" for k, v in doc["levers_applied"].items()) or "none"))
    if doc["levers_left_alone"]:
        lines.append("left alone: " + "; ".join(f"{k} ({v})" for k, v in doc["levers_left_alone"].items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True, type=Path, help="the bundle folder (configs/ inside)")
    ap.add_argument(
        "--config_file",
        "--config-file",
        dest="config_file",
        default=None,
        help="config file(s) as monai.bundle takes them (default configs/train.json|yaml)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="pairs of runs (default %(default)s)")
    ap.add_argument("--epochs", type=int, default=3, help="training epochs per run: train#trainer#max_epochs")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run (default %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where the JSON goes")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config overrides, id=value (data, device, sizes)")
    args = ap.parse_args(argv)
    if args.child:
        return _child(args)
    if not (args.bundle / "configs").is_dir():
        raise SystemExit(f"bundle bench: {args.bundle} has no configs/ folder")
    if args.repeats < 1 or args.epochs < 1:
        raise SystemExit("bundle bench: --repeats and --epochs must be at least 1")
    overrides = [*args.overrides, f"train#trainer#max_epochs={args.epochs}"]
    work = Path(tempfile.mkdtemp(prefix="bundle-bench-"))
    runs = []
    try:
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                doc = run_variant(args.bundle.resolve(), variant, overrides, args.config_file, work, args.timeout)
                runs.append(doc)
                print(
                    f"repeat {repeat + 1} {variant}: {doc['wall_s']:.1f} s, per epoch "
                    f"{_per_epoch(doc['epochs'])} s, {_dice(doc['metrics'])}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fast_applied = runs[1]["applied"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    doc = {
        "benchmark": "bundle",
        "bundle": args.bundle.name,
        "bundle_path": str(args.bundle),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "description": device_description("cpu"),
            "python": platform.python_version(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
            "bf16_hardware": cpu_has_bf16_hardware(),
        },
        "overrides": overrides,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "metric": _dice(runs[0]["metrics"])[0],
        "levers_applied": {k: v.get("setting") for k, v in fast_applied.items() if v.get("applied")},
        "levers_left_alone": {k: v.get("reason") for k, v in fast_applied.items() if not v.get("applied")},
        "runs": runs,
        "summary": summarise(runs),
    }
    print(_table(doc))
    out = write_json(doc, Path(args.out) / f"bundle_{args.bundle.name}_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
