"""A MONAI bundle as published against ``monai-fast bundle run``: per-epoch time, final Dice, the levers applied.

Each run is its own process on its own copy of the bundle (so the two variants share no cache, no process state
and no output folder), with the same overrides and seed; the variants take turns (published, fast, published,
fast, ...) so that a slow spell of a shared machine hits both. The per-epoch time is read from each run's record:
the training epoch's data wait and compute (``TimeBreakdown``'s epoch rows) plus the validation spans that ended in
that epoch. The first epoch is reported apart (it carries cache filling and FastTraining's measurements); the
per-epoch figure is the median of the epochs after it (the first alone when there is one epoch); the whole run is
the run's wall clock from loading the bundle to its end (compiling, when FastTraining compiles, included). Ratios
are published over each other variant, repeat by repeat. The final validation metric is the evaluator's
(``BundleResult.metrics``).

The variants (``--variants``): ``published`` (``--no-fast``), ``fast`` (FastTraining's defaults), ``eager``
(``compile=False``), ``compiled`` (``compile=True``), ``channels_last`` (``memory_format="channels_last_3d"``) and
``contiguous`` (``memory_format="contiguous"``).
By default a run's plan is ``--epochs`` epochs (``max_epochs`` overridden); with ``--plan`` the bundle keeps its
own ``max_epochs`` (the plan FastTraining weighs a compile against) and a handler appended to the trainer's
handlers ends the run after ``--epochs`` epochs.

    python benchmarks/bundle.py --bundle /path/to/spleen_ct_segmentation --repeats 2 --epochs 3 \\
        dataset_dir=/data/Task09_Spleen "device=\\$torch.device('cpu')"
    python benchmarks/bundle.py --bundle ... --plan --epochs 4 --variants published,fast,eager ...
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


__all__ = [
    "StopAfterEpochs",
    "check_variants",
    "epoch_times",
    "main",
    "run_variant",
    "stop_after_overrides",
    "summarise",
]

#: each variant's FastTraining options (``None``: the bundle as published, nothing attached)
VARIANTS: dict[str, dict[str, Any] | None] = {
    "published": None,
    "fast": {},
    "eager": {"compile": False},
    "compiled": {"compile": True},
    "channels_last": {"memory_format": "channels_last_3d"},
    "contiguous": {"memory_format": "contiguous"},
}


class StopAfterEpochs:
    """Ends the trainer's run after ``epochs`` epochs, whatever its ``max_epochs``.

    ignite's ``terminate()`` only asks the engine to stop: the epoch's other handlers (its validation) still run.
    """

    def __init__(self, epochs: int) -> None:
        if int(epochs) < 1:
            raise ValueError(f"StopAfterEpochs: epochs must be at least 1, got {epochs}")
        self.epochs = int(epochs)

    def attach(self, engine: Any) -> None:
        from ignite.engine import Events

        engine.add_event_handler(Events.EPOCH_COMPLETED(once=self.epochs), lambda e: e.terminate())


def check_variants(text: str) -> list[str]:
    """The variants of a comma-separated ``--variants``: ``published`` first, ``fast`` among them, each once.

    Raises:
        SystemExit: any other list, named.
    """
    variants = [v.strip() for v in text.split(",") if v.strip()]
    if (
        variants[:1] != ["published"]
        or "fast" not in variants
        or len(set(variants)) != len(variants)
        or not set(variants) <= set(VARIANTS)
    ):
        raise SystemExit(
            f"bundle bench: --variants {text!r}: published first, fast among them, each once, of {list(VARIANTS)}"
        )
    return variants


def stop_after_overrides(
    bundle: Path, config_file: str | None, trainer_id: str, epochs: int, overrides: dict[str, Any]
) -> tuple[dict[str, Any], int]:
    """The override that appends `StopAfterEpochs` to the trainer's ``train_handlers`` list (followed through a
    ``@`` reference to the list's own id), and the trainer's planned ``max_epochs``.

    Raises:
        SystemExit: the trainer has no handler list to append to, named.
    """
    from monai_fast.bundle import bundle_config_files
    from monai_fast.bundle.pieces import read_config

    files = bundle_config_files(bundle, None if config_file is None else str(config_file))
    parser = read_config(Path(bundle), files, overrides)
    handlers_id = f"{trainer_id}#train_handlers"
    ref = parser.get(handlers_id)
    if isinstance(ref, str) and ref.startswith("@"):
        handlers_id = ref[1:]
        ref = parser.get(handlers_id)
    if not isinstance(ref, list):
        raise SystemExit(f"bundle bench: --plan needs {trainer_id}#train_handlers as a list (or a reference to one)")
    stop = {"_target_": "bundle.StopAfterEpochs", "epochs": epochs}
    return {handlers_id: [*ref, stop]}, int(parser.get_parsed_content(f"{trainer_id}#max_epochs"))


def epoch_times(rows: Sequence[dict]) -> list[dict[str, float]]:
    """Per training epoch: ``train_s`` (data wait ``data_s`` + compute), ``validation_s``, their sum ``epoch_s``.

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
                "data_s": round(float(e["data_s"]), 4),
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
    options = VARIANTS[args.variant]
    start = time.perf_counter()
    result = run_bundle(
        args.bundle,
        config_files=args.config_file,
        overrides=overrides,
        fast=options is not None,
        fast_options=options,
        trainer_id=args.trainer_id,
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
    bundle: Path,
    variant: str,
    overrides: Sequence[str],
    config_file: str | None,
    work: Path,
    timeout: float,
    trainer_id: str = "train#trainer",
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
        "--trainer-id",
        trainer_id,
    ]
    if config_file:
        cmd += ["--config_file", config_file]
    cmd += list(overrides)
    path = os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}  # benchmarks/ for the StopAfterEpochs handler of --plan
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


def summarise(runs: Sequence[dict], variants: Sequence[str] = ("published", "fast")) -> dict[str, Any]:
    """Repeats (``variants`` in run order) with published over each other variant, per epoch and over the whole
    run, and the medians over repeats. The ``fast`` variant's figures keep the plain keys (``fast_s``, ``ratio``,
    ``run_ratio``); another variant ``v`` has ``v_s``, ``ratio_v``, ``run_ratio_v`` and ``v_metric``."""
    n = len(variants)
    pairs = []
    for i in range(0, len(runs) - n + 1, n):
        group = dict(zip(variants, runs[i : i + n]))
        a = group["published"]
        pa = _per_epoch(a["epochs"])
        pair: dict[str, Any] = {
            "repeat": i // n + 1,
            "published_s": pa,
            "published_run_s": a["wall_s"],
            "published_first_epoch_s": a["epochs"][0]["epoch_s"] if a["epochs"] else None,
            "published_metric": _dice(a["metrics"])[1],
        }
        for v, b in group.items():
            if v == "published":
                continue
            pb = _per_epoch(b["epochs"])
            tag = "" if v == "fast" else f"_{v}"
            pair.update(
                {
                    f"{v}_s": pb,
                    f"ratio{tag}": round(pa / pb, 4) if pa and pb else None,
                    f"{v}_run_s": b["wall_s"],
                    f"run_ratio{tag}": round(a["wall_s"] / b["wall_s"], 4) if a["wall_s"] and b["wall_s"] else None,
                    f"{v}_first_epoch_s": b["epochs"][0]["epoch_s"] if b["epochs"] else None,
                    f"{v}_metric": _dice(b["metrics"])[1],
                    f"{v}_compile": (b["applied"].get("compile") or {}).get("setting"),
                    f"{v}_layout": (b["applied"].get("memory_format") or {}).get("setting"),
                }
            )
        pairs.append(pair)
    out: dict[str, Any] = {"pairs": pairs}
    for v in variants[1:]:
        tag = "" if v == "fast" else f"_{v}"
        for key in (f"ratio{tag}", f"run_ratio{tag}"):
            values = [p[key] for p in pairs if p.get(key) is not None]
            out[f"median_{key}"] = round(statistics.median(values), 4) if values else None
    return out


def _table(doc: dict) -> str:
    variants = doc.get("variants", ["published", "fast"])
    plan = f", the bundle's plan kept ({doc['plan_epochs']} epochs)" if doc.get("plan_epochs") else ""
    lines = [
        f"bundle {doc['bundle']}: {doc['epochs']} epoch(s){plan}, {doc['repeats']} repeat(s), metric {doc['metric']}",
        "| repeat | variant | s/epoch | ratio | first epoch s | whole run s | run ratio | metric | compile | layout |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    for p in doc["summary"]["pairs"]:
        for v in variants:
            tag = "" if v in ("fast", "published") else f"_{v}"
            ratio = None if v == "published" else p.get(f"ratio{tag}")
            run_ratio = None if v == "published" else p.get(f"run_ratio{tag}")
            lines.append(
                f"| {p['repeat']} | {v} | {f(p.get(f'{v}_s'))} | {f(ratio)} | {f(p.get(f'{v}_first_epoch_s'))} | "
                f"{f(p.get(f'{v}_run_s'))} | {f(run_ratio)} | {f(p.get(f'{v}_metric'))} | "
                f"{f(p.get(f'{v}_compile'))} | {f(p.get(f'{v}_layout'))} |"
            )
    summary = doc["summary"]
    for v in variants[1:]:
        tag = "" if v == "fast" else f"_{v}"
        lines.append(
            f"median ratio (published / {v}): per epoch {f(summary.get(f'median_ratio{tag}'))}, "
            f"whole run {f(summary.get(f'median_run_ratio{tag}'))}"
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
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the variants (default %(default)s)")
    ap.add_argument(
        "--epochs", type=int, default=3, help="training epochs per run: the trainer's max_epochs, or where --plan stops"
    )
    ap.add_argument(
        "--plan",
        action="store_true",
        help="keep the bundle's own max_epochs (the plan a compile is weighed against) and stop after --epochs",
    )
    ap.add_argument(
        "--variants",
        default="published,fast",
        help=f"comma-separated, published first, of {', '.join(VARIANTS)} (default %(default)s)",
    )
    ap.add_argument("--trainer-id", default="train#trainer", help="the trainer's config id (default %(default)s)")
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
    variants = check_variants(args.variants)
    plan_epochs = None
    if args.plan:
        from monai_fast.bundle import parse_overrides

        extra, plan_epochs = stop_after_overrides(
            args.bundle, args.config_file, args.trainer_id, args.epochs, parse_overrides(args.overrides)
        )
        if plan_epochs <= args.epochs:
            raise SystemExit(f"bundle bench: --plan: the bundle plans {plan_epochs} epochs, not more than --epochs")
        overrides = [*args.overrides, *(f"{k}={json.dumps(v)}" for k, v in extra.items())]
    else:
        overrides = [*args.overrides, f"{args.trainer_id}#max_epochs={args.epochs}"]
    work = Path(tempfile.mkdtemp(prefix="bundle-bench-"))
    runs = []
    try:
        for repeat in range(args.repeats):
            for variant in variants:
                doc = run_variant(
                    args.bundle.resolve(), variant, overrides, args.config_file, work, args.timeout, args.trainer_id
                )
                runs.append(doc)
                print(
                    f"repeat {repeat + 1} {variant}: {doc['wall_s']:.1f} s, per epoch "
                    f"{_per_epoch(doc['epochs'])} s, {_dice(doc['metrics'])}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fast_applied = runs[variants.index("fast")]["applied"]
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
        "plan_epochs": plan_epochs,
        "variants": variants,
        "repeats": args.repeats,
        "metric": _dice(runs[0]["metrics"])[0],
        "levers_applied": {k: v.get("setting") for k, v in fast_applied.items() if v.get("applied")},
        "levers_left_alone": {k: v.get("reason") for k, v in fast_applied.items() if not v.get("applied")},
        "runs": runs,
        "summary": summarise(runs, variants),
    }
    print(_table(doc))
    out = write_json(doc, Path(args.out) / f"bundle_{args.bundle.name}_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
