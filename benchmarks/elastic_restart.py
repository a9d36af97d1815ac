"""Elastic restart: what a SIGKILL of one rank costs under ``monai-fast launch --max-restarts 1``.

Runs ``tutorials/distributed_train.py`` (the ``fast`` recipe, fp32 and batch 1 so that runs are
bit-reproducible on a CPU) with 2 ranks under the real launcher, first uninterrupted (no
checkpoints), then once per ``--save-every N``: checkpoints every N iterations
(``Preemption(save_every=N)``), and rank 1 killed with SIGKILL right after iteration ``2N - 1``
(``2`` for N = 1), the last one before the next checkpoint, mid-epoch where the epoch allows. torchrun
restarts both ranks; they resume from the latest checkpoint and run to the end
(``drill.kill_drill``, the scenario of ``tests/faults/test_elastic_restart.py``).

Per N it prints: iterations redone (completed twice), the restart's wall time (from the SIGKILL to the
first iteration completed after the resume: torchrun noticing, stopping rank 0, starting both ranks,
imports, the cache fill, loading the checkpoint, one iteration), the whole run's wall time against
the uninterrupted run, and whether the final weights equal the uninterrupted run's bit for bit.
Times come from polling the tutorial's progress file every 10 ms. Writes JSON.

    python benchmarks/elastic_restart.py                                   # the tutorial's default size, N = 1 3 6
    python benchmarks/elastic_restart.py --tiny --save-every 2 --epochs 3  # the test's toy run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

from drill import KillDrill, TimedRun, kill_drill, timed_launch

TUTORIAL = Path(__file__).resolve().parents[1] / "tutorials" / "distributed_train.py"
RANKS = 2


def kill_point(save_every: int) -> int:
    """The iteration after which rank 1 is killed: the last one before the second checkpoint."""
    return save_every + max(1, save_every - 1)


def _digests(out: Path) -> list[str]:
    return [json.loads((out / f"rank{r}.json").read_text())["weights_sha1"] for r in range(RANKS)]


def _checked(run: TimedRun, what: str) -> TimedRun:
    if run.returncode != 0:
        raise SystemExit(f"elastic_restart: the {what} run failed (exit status {run.returncode}):\n{run.log[-3000:]}")
    return run


def _row(save_every: int, drill: KillDrill, ref: TimedRun, out: Path, expected: str) -> dict:
    resumed_from = json.loads((out / "rank0.json").read_text())["resumed_from"]
    return {
        "save_every": save_every,
        "killed_after": drill.killed_after,
        "resumed_from": resumed_from,
        "iterations_redone": drill.redone,
        "restart_s": drill.restart_s,
        "redone_compute_s": drill.redone * ref.iteration_s(),
        "wall_s": drill.wall_s,
        "uninterrupted_wall_s": ref.wall_s,
        "extra_s": drill.wall_s - ref.wall_s,
        "steps": drill.steps,
        "weights_equal": all(d == expected for d in _digests(out)),
    }


def _table(rows: list[dict], ref: TimedRun) -> str:
    lines = [
        f"uninterrupted: {ref.wall_s:.1f} s, {len(ref.steps)} iterations, median {ref.iteration_s():.2f} s apart",
        f"{'save every':>10} {'killed after':>12} {'resumed at':>10} {'redone':>6} {'restart s':>9} "
        f"{'total s':>8} {'vs uninterrupted':>17} {'equal weights':>13}",
    ]
    for r in rows:
        extra = f"+{r['extra_s']:.1f} s ({r['wall_s'] / ref.wall_s:.2f}x)"
        lines.append(
            f"{r['save_every']:>10} {r['killed_after']:>12} {str(r['resumed_from']):>10} {r['iterations_redone']:>6} "
            f"{r['restart_s']:>9.1f} {r['wall_s']:>8.1f} {extra:>17} {'yes' if r['weights_equal'] else 'NO':>13}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save-every", type=int, nargs="+", default=[1, 3, 6], help="checkpoint intervals (iterations)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run (the tutorial's --max-epochs)")
    ap.add_argument(
        "--tiny", action="store_true", help="the tutorial's --tiny data and patches (2 iterations per epoch)"
    )
    ap.add_argument("--timeout-s", type=float, default=900.0, help="the most one run may take")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if min(args.save_every) < 1 or args.epochs < 1:
        ap.error(f"--save-every {args.save_every} and --epochs {args.epochs} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="elastic-restart-") as tmp:
        ref, rows = _measure(args, Path(tmp))
    from monai_fast.files import write_json
    from monai_fast.telemetry import device_description

    print("\n" + _table(rows, ref))
    doc = {
        "benchmark": "elastic_restart",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": device_description("cpu"),
        "command": " ".join([sys.executable, *sys.argv]),
        "ranks": RANKS,
        "tiny": args.tiny,
        "epochs": args.epochs,
        "uninterrupted": {
            "wall_s": ref.wall_s,
            "iterations": len(ref.steps),
            "iteration_s": ref.iteration_s(),
            "steps": ref.steps,
        },
        "rows": rows,
    }
    out = Path(args.out) / f"elastic_restart_{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    write_json(doc, out)
    print(f"wrote {out}")
    return 0


def _measure(args: argparse.Namespace, work: Path) -> tuple[TimedRun, list[dict]]:
    """The uninterrupted run, then one kill drill per ``--save-every``, in ``work``."""
    from monai_fast.apps.sources.synthetic import generate_msd  # after the arguments are checked: imports MONAI

    data = generate_msd(
        work / "data",
        num_cases=6 if args.tiny else 16,
        shape=(48, 48, 32) if args.tiny else (128, 128, 64),
        progress=False,
    )
    common = [
        str(TUTORIAL),
        "--fp32",
        "--batch-size",
        "1",
        "--data-dir",
        str(data),
        "--max-epochs",
        str(args.epochs),
        *(["--tiny"] if args.tiny else []),
    ]
    ref = _checked(
        timed_launch(
            [*common, "--out", str(work / "ref"), "--progress-file", str(work / "ref.progress")],
            work / "ref.progress",
            work / "ref.log",
            nproc=RANKS,
            timeout_s=args.timeout_s,
        ),
        "uninterrupted",
    )
    total, expected = len(ref.steps), _digests(work / "ref")[0]
    late = [n for n in args.save_every if kill_point(n) >= total]
    if late:
        raise SystemExit(
            f"elastic_restart: --save-every {late}: the kill point (iteration 2N-1) must come before the run's "
            f"last iteration ({total}); raise --epochs or lower --save-every"
        )
    print(f"uninterrupted: {ref.wall_s:.1f} s for {total} iterations", flush=True)
    rows = []
    for n in args.save_every:
        run = work / f"every{n}"
        drill = kill_drill(
            [
                *common,
                "--out",
                str(run),
                "--checkpoint-dir",
                str(run / "ckpt"),
                "--save-every",
                str(n),
                "--progress-file",
                str(run / "progress"),
            ],
            run / "progress",
            work / f"every{n}.log",
            kill_after=kill_point(n),
            nproc=RANKS,
            timeout_s=args.timeout_s,
        )
        rows.append(_row(n, _checked(drill, f"--save-every {n}"), ref, run, expected))
        print(
            f"save every {n}: killed after {drill.killed_after}, {drill.redone} redone, "
            f"restart {drill.restart_s:.1f} s, "
            f"total {drill.wall_s:.1f} s",
            flush=True,
        )
    return ref, rows


if __name__ == "__main__":
    sys.exit(main())
