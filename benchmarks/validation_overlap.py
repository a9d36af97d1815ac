"""Time to a Dice target with validation every epoch (sync), on a schedule, or in the background.

The same recipe (``fast`` by default) on the same data, three ways, interleaved and repeated:

* ``sync``: MONAI's ``ValidationHandler``, full validation after every epoch (MONAI's usual set-up);
* ``schedule``: :class:`~monai_fast.handlers.ValidationSchedule`: a cheap estimate on the first
  ``--subset`` validation cases decides when the full validation runs (every ``--every`` epochs
  while far, every epoch once within ``--margin``);
* ``background``: :class:`~monai_fast.handlers.BackgroundValidation`: a weight snapshot validated
  in a thread (CUDA: a side stream) while training goes on.

The target is only ever declared by a full validation (``TimeToTarget`` on the full evaluator).
Times are wall clock from before the data sets are built. Prints a table and writes
``<out>/validation_overlap_<time>.json`` with every run::

    python benchmarks/validation_overlap.py --repeats 2    # the real numbers
    # toy:
    python benchmarks/validation_overlap.py --cases 6 --shape 48 48 32 --patch 32 32 32 --max-epochs 3 --target 0.05


"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

from monai.handlers import MeanDice, from_engine
from monai.transforms import AsDiscreted, Compose
from torch.utils.data import DataLoader, Subset

from monai_fast.apps.recipes import RECIPES, RecipeConfig, build_recipe
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.files import write_json
from monai_fast.handlers import BackgroundValidation, TimeToTarget, ValidationSchedule
from monai_fast.handlers.validation_schedule import estimator_like

VARIANTS = ("sync", "schedule", "background")
NEVER = 10**9  # a ValidationHandler interval that never fires: the variant validates on its own


def run_variant(variant: str, args: argparse.Namespace, files: tuple[list, list], seed: int) -> dict:
    """One run of the recipe to the target with validation done the ``variant`` way."""
    t0 = time.perf_counter()
    config = RecipeConfig(
        max_epochs=args.max_epochs,
        seed=seed,
        val_interval=1 if variant == "sync" else NEVER,
        **({"patch_size": tuple(args.patch)} if args.patch else {}),
    )
    recipe = build_recipe(args.recipe, files[0], files[1], config, args.device, progress=False)
    trainer, evaluator = recipe.trainer, recipe.evaluator
    if variant == "schedule":
        post = Compose([AsDiscreted(keys="pred", argmax=True, to_onehot=2), AsDiscreted(keys="label", to_onehot=2)])
        subset = DataLoader(
            Subset(recipe.val_loader.dataset, range(min(args.subset, len(recipe.val_loader.dataset)))),
            batch_size=1,
            num_workers=0,
        )
        metric = {"val_mean_dice": MeanDice(include_background=False, output_transform=from_engine(["pred", "label"]))}
        ValidationSchedule(
            evaluator,
            estimator_like(evaluator, subset, metric, post),
            target=args.target,
            margin=args.margin,
            every=args.every,
        ).attach(trainer)
    elif variant == "background":
        BackgroundValidation(evaluator).attach(trainer)
    stopper = TimeToTarget(
        args.target, metric_name="val_mean_dice", time_budget_s=args.time_budget, start_time=t0, stop_on="stable"
    )
    stopper.attach(trainer, evaluator)
    trainer.run()
    return {
        "variant": variant,
        "seed": seed,
        "first_s": stopper.reached_s,
        "first_epoch": stopper.reached_epoch,
        "stable_s": stopper.stable_s,
        "stable_epoch": stopper.stable_epoch,
        "epochs_run": trainer.state.epoch,
        "full_validations": len(stopper.history),
        "best_dice": stopper.best,
        "setup_s": recipe.setup_s,
        "total_s": time.perf_counter() - t0,
        "budget_exhausted": stopper.budget_exhausted,
        "history": stopper.history,
    }


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def table(runs: list[dict]) -> str:
    """Medians per variant: time to first and stable target, epochs, full validations."""
    lines = [f"{'variant':<11} {'first s':>8} {'stable s':>9} {'epochs':>7} {'full vals':>9} {'best':>6}"]
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        if not mine:
            continue
        cells = [_median(mine, k) for k in ("first_s", "stable_s", "epochs_run", "full_validations", "best_dice")]
        shown = [
            "-" if c is None else f"{c:.1f}" if i < 2 else f"{c:.0f}" if i < 4 else f"{c:.3f}"
            for i, c in enumerate(cells)
        ]
        lines.append(f"{variant:<11} {shown[0]:>8} {shown[1]:>9} {shown[2]:>7} {shown[3]:>9} {shown[4]:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", choices=RECIPES, default="fast")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=2, help="rounds of all variants, interleaved (default %(default)s)")
    p.add_argument("--target", type=float, default=0.9, help="validation mean Dice (default %(default)s)")
    p.add_argument("--margin", type=float, default=0.1, help="schedule: 'close' margin (default %(default)s)")
    p.add_argument(
        "--every", type=int, default=5, help="schedule: full validation every k epochs while far (default %(default)s)"
    )
    p.add_argument(
        "--subset", type=int, default=2, help="schedule: validation cases of the estimate (default %(default)s)"
    )
    p.add_argument("--time-budget", type=float, default=1200.0, help="seconds per run (default %(default)s)")
    p.add_argument("--max-epochs", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--cases", type=int, default=40, help="synthetic cases (default %(default)s)")
    p.add_argument(
        "--shape", type=int, nargs=3, default=(128, 128, 96), help="synthetic volume size (default %(default)s)"
    )
    p.add_argument("--patch", type=int, nargs=3, help="training patch / sliding-window ROI (default: the recipe's)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = generate_msd(
            Path(tmp) / "data", "spleen-like", num_cases=args.cases, shape=tuple(args.shape), progress=False
        )
        files = load_msd_datalist(root, val_fraction=0.2, seed=0)
        runs = []
        for repeat in range(args.repeats):
            for variant in args.variants:  # interleaved: a slow spell of the machine hits every variant
                runs.append(run_variant(variant, args, files, seed=repeat))
                r = runs[-1]
                print(
                    f"repeat {repeat} {variant:<10} first {r['first_s']} s, stable {r['stable_s']} s, "
                    f"{r['epochs_run']} epochs, {r['full_validations']} full validations",
                    flush=True,
                )
    print(table(runs))
    path = Path(args.out) / f"validation_overlap_{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json({"options": vars(args), "runs": runs}, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
