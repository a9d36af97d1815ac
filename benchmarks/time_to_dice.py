"""Time-to-Dice benchmark: baseline vs monai_tutorial vs fast on the same data, in the same run.

Calls the library (:func:`monai_fast.apps.demo.bench`), as ``monai-fast bench`` does; that command has
every option (patch size, channels, tuning...), this script the ones a benchmark run needs::

    python benchmarks/time_to_dice.py --repeats 2
    python benchmarks/time_to_dice.py --recipes monai_tutorial fast --time-budget 600 --device cuda
    python benchmarks/time_to_dice.py --patch 96 96 96 --channels 16 32 64 128 256 --res-units 2 --data-dir DIR

Prints a line per recipe and the medians, and writes ``benchmarks/results/time_to_dice_<time>.json``
with every epoch of every run, the machine and the package versions.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from monai_fast.apps.demo import OptionError, RaceEvents, RaceSpec, SyntheticData, bench
from monai_fast.apps.recipes import RECIPES


class _Say(RaceEvents):
    def repeat_started(self, index: int, repeats: int) -> None:
        print(f"== repeat {index}/{repeats}", flush=True)

    def recipe_finished(self, r) -> None:
        state = f"reached in {r.time_to_target_s:.1f} s" if r.reached else f"not reached in {r.total_s:.0f} s"
        print(f"   {r.recipe}: {state}, best Dice {r.best_dice or 0:.3f}, {r.epochs_run} epochs", flush=True)


def recipe_sizes(args: argparse.Namespace) -> dict:
    """The recipe options ``--patch``, ``--channels`` and ``--res-units`` override (``overlaps.py`` uses it too)."""
    out: dict = {}
    if args.patch:
        out["patch_size"] = tuple(args.patch)
    if args.channels:
        out.update(channels=tuple(args.channels), strides=(2,) * (len(args.channels) - 1))
    if args.res_units is not None:
        out["num_res_units"] = args.res_units
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", choices=RECIPES, default=["baseline", "monai_tutorial", "fast"])
    p.add_argument(
        "--repeats", type=int, default=1, help="races with training seeds seed, seed+1, ... (default %(default)s)"
    )
    p.add_argument("--target", type=float, default=0.9, help="validation mean Dice to reach (default %(default)s)")
    p.add_argument("--time-budget", type=float, default=1200.0, help="seconds per recipe (default %(default)s)")
    p.add_argument("--max-epochs", type=int, default=200, help="epoch limit per recipe (default %(default)s)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 (default %(default)s)")
    p.add_argument("--data-dir", help="an MSD-layout folder; default: synthetic spleen-like data")
    p.add_argument("--cases", type=int, default=16, help="synthetic cases (default %(default)s)")
    p.add_argument(
        "--shape", type=int, nargs=3, default=(128, 128, 64), help="synthetic volume size (default %(default)s)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of data and split, first training seed (default %(default)s)"
    )
    p.add_argument("--patch", type=int, nargs=3, help="training crop / sliding window (default: the recipes' 64^3)")
    p.add_argument(
        "--channels", type=int, nargs="+", help="UNet channels, stride 2 each (default: the recipes' 8 16 32 64)"
    )
    p.add_argument("--res-units", type=int, help="UNet residual units per level (default: the recipes' 1)")
    p.add_argument("--run-dir", help="run folders of the repeats (default runs/bench-<time>)")
    p.add_argument("--out", default="benchmarks/results", help="folder of the JSON (default %(default)s)")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    overrides: dict = {"max_epochs": args.max_epochs, **recipe_sizes(args)}
    spec = RaceSpec(
        recipes=args.recipes,
        data_dir=args.data_dir,
        synthetic=SyntheticData(cases=args.cases, shape=tuple(args.shape)),
        seed=args.seed,
        target=args.target,
        time_budget_s=args.time_budget,
        device=args.device,
        overrides=overrides,
        run_dir=args.run_dir,
        progress=False,
        record_options=vars(args),
    )
    try:
        done = bench(spec, repeats=args.repeats, out_dir=args.out, events=_Say())
    except OptionError as e:
        p.error(str(e))
    print(json.dumps(done.summary, indent=2))
    print(f"wrote {done.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
