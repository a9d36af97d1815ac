"""One recipe, this checkout against another (an older commit): does a change make it slower?

Runs ``benchmarks/time_to_dice.py --recipes RECIPE`` from each source tree in turn (old, new,
old, new, ...: a change of the host's load hits both), each in its own process with that tree on
``PYTHONPATH``, on the same synthetic data and seeds, and compares set-up, seconds per training
and validation epoch, epochs and time to the Dice target::

    git worktree add /tmp/old <commit>
    python benchmarks/recipe_vs_commit.py --old /tmp/old --repeats 2

Prints a table (medians and new/old ratios; < 1 means the new tree is faster) and writes
``benchmarks/results/recipe_vs_commit_<time>.json`` with every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from monai_fast.files import write_json

NEW = Path(__file__).resolve().parents[1]
FIELDS = ("setup_s", "train_s_per_epoch", "val_s_per_epoch", "epochs_to_target", "time_to_target_s")


def run_tree(tree: Path, args: argparse.Namespace, seed: int, out: Path) -> dict:
    """The recipe's result from ``tree``'s own ``time_to_dice.py`` (one repeat, training seed ``seed``)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(tree / "benchmarks" / "time_to_dice.py"),
        "--recipes",
        args.recipe,
        "--repeats",
        "1",
        "--seed",
        str(seed),
        "--cases",
        str(args.cases),
        "--shape",
        *map(str, args.shape),
        "--target",
        str(args.target),
        "--time-budget",
        str(args.time_budget),
        "--out",
        str(out),
        "--run-dir",
        str(out / "runs"),
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(cmd, env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL)
    result = json.loads(next(out.glob("time_to_dice_*.json")).read_text())
    return next(r for r in result["repeats"][0] if r["recipe"] == args.recipe)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, type=Path, help="a checkout of the commit to compare with")
    p.add_argument("--recipe", default="fast")
    p.add_argument("--repeats", type=int, default=2, help="runs per tree, alternating (default %(default)s)")
    p.add_argument("--cases", type=int, default=16)
    p.add_argument("--shape", type=int, nargs=3, default=(128, 128, 64))
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--time-budget", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=NEW / "benchmarks" / "results")
    args = p.parse_args(argv)
    if not (args.old / "benchmarks" / "time_to_dice.py").is_file():
        p.error(f"--old {args.old}: no benchmarks/time_to_dice.py there (a checkout of this project?)")
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, tree in (("old", args.old.resolve()), ("new", NEW)):
                r = run_tree(tree, args, seed=i, out=Path(tmp) / f"{name}{i}")
                runs[name].append({k: r.get(k) for k in (*FIELDS, "reached", "best_dice", "notes")})
                print(f"{name} #{i + 1}: " + ", ".join(f"{k} {r.get(k)}" for k in FIELDS), flush=True)
    table = {}
    print(f"\n{'':>20} {'old':>9} {'new':>9} {'new/old':>8}")
    for k in FIELDS:
        med = {n: statistics.median(v) if (v := [r[k] for r in runs[n] if r[k] is not None]) else None for n in runs}
        ratio = med["new"] / med["old"] if med["old"] and med["new"] is not None else None
        table[k] = {**med, "ratio": ratio}
        print(
            f"{k:>20} {med['old'] or float('nan'):9.2f} {med['new'] or float('nan'):9.2f} {ratio or float('nan'):8.2f}"
        )
    path = args.out / f"recipe_vs_commit_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(
        {
            "recipe": args.recipe,
            "old": str(args.old),
            "options": {k: str(v) for k, v in vars(args).items()},
            "runs": runs,
            "medians": table,
        },
        path,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
