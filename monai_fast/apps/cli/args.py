"""The options shared by ``demo``, ``bench``, ``tune`` and ``train``, and their translation into recipe options.

Each default shown comes from where it is defined (`RecipeConfig`, the synthetic set, `demo_scale()`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from monai_fast.apps.cli import add_options
from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.training.data import VAL_FRACTION, DemoScale, SyntheticData, demo_scale
from monai_fast.data.planner import CACHE_CHOICES
from monai_fast.telemetry.precision import REQUESTS

__all__ = [
    "FLAGS",
    "add_data_options",
    "add_model_options",
    "add_race_options",
    "add_tuning_options",
    "add_validation_options",
    "flag_of",
    "recipe_overrides",
    "scaled_options",
]

FLAGS = {
    "synthetic.cases": "--cases",
    "synthetic.shape": "--shape",
    "time_budget_s": "--time-budget",
    "total_budget_s": "--total-budget",
    "out_dir": "--out",
    "overrides": "bad option",
    "tune": "bad tuning option",
}
"""The command-line name of an `OptionError`'s option where it is not ``--<option>``."""

#: the help of the options whose help is long and fixed
_HELP = {
    "--data-dir": "an MSD-layout folder with dataset.json (e.g. Task09_Spleen), or its URL (s3://bucket/Task09_Spleen, "
    "any fsspec URL); default: synthetic spleen-like data",
    "--no-preflight": "skip the check of every file before training (unreadable files, 2D volumes, NaN/Inf, labels "
    "outside the classes, shape mismatches; cached per file, so only the first run reads them)",
    "--cache": "where fast caches its training data (default auto: measured by the cache planner)",
    "--tune": "tune fast's batch size, sliding-window batch, validation device and precision first (cached per machine "
    "and model; see 'monai-fast tune --help')",
    "--place-cache": "also place the training cache: in device memory (GPU on CUDA, RAM on a CPU) when it fits beside "
    "the pick's measured peak, else beside a smaller batch within --cache-tradeoff of its throughput, else where the "
    "cache planner sends it",
    "--cache-tradeoff": "largest share of training throughput given up to fit the cache in device memory "
    "(default %(default)s)",
    "--tune-cache": "the JSON file of tuning results "
    "(default $MONAI_FAST_CACHE/tuning.json or ~/.cache/monai-fast/tuning.json)",
    "--time-budget": "seconds each recipe may run before it is stopped (default %(default)s; the demo: none, "
    "--total-budget bounds the whole run)",
    "--background-fill": "fast: fill the caches while training runs (first epoch in fill order; runs not reproducible)",
    "--run-dir": "where results.json, epochs.csv, the PNG and TensorBoard events go (default runs/<command>-<time>)",
}


def flag_of(option: str) -> str:
    """The command-line option that sets the option ``option`` (``"time_budget_s"``: ``"--time-budget"``)."""
    return FLAGS.get(option, "--" + option.replace("_", "-"))


def add_data_options(p: argparse.ArgumentParser) -> None:
    """Where the data comes from, the device and the seed."""
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", help=_HELP["--data-dir"])
    small, cuda = SyntheticData(), demo_scale(torch.device("cuda")).synthetic
    cases = f"{small.cases}; demo and train on CUDA: {cuda.cases}"
    shape = f"{_spaced(small.shape)}; demo and train on CUDA: {_spaced(cuda.shape)}"
    add_options(
        g,
        (
            ("--cases", int, None, f"synthetic cases to generate (default {cases})"),
            ("--shape", int, None, f"synthetic volume size in voxels (default {shape})", _XYZ),
            ("--val-fraction", float, VAL_FRACTION, "share of cases held out for validation (default %(default)s)"),
            ("--device", None, "auto", "'auto' (CUDA if present), 'cpu', 'cuda', 'cuda:1' (default %(default)s)"),
            ("--seed", int, 0, "seed of data, split, weights and crops (default %(default)s)"),
        ),
    )
    g.add_argument("--no-preflight", action="store_true", help=_HELP["--no-preflight"])


_XYZ = {"nargs": 3, "metavar": ("X", "Y", "Z")}


def _spaced(values: Sequence[int]) -> str:
    return " ".join(map(str, values))


def add_validation_options(g: argparse._ActionsContainer) -> None:
    """``--validation`` and ``--val-interval`` (``demo``, ``bench``, ``train``), their defaults the recipes' own."""
    from monai_fast.apps.recipes import REGISTRY

    cfg = RecipeConfig()
    g.add_argument(
        "--validation",
        choices=("every_epoch", "schedule"),
        help="when the full validation runs: every --val-interval epochs, or on a schedule: a Dice estimate "
        f"on {cfg.val_subset} validation cases after every epoch, the full validation every "
        f"{cfg.val_every} epochs while the estimate is far below the target, every epoch once near "
        f"it, and at the last epoch (default: the recipe's; fast: {REGISTRY['fast'].defaults['validation']}, "
        "the others: every_epoch)",
    )
    g.add_argument(
        "--val-interval",
        type=int,
        help=f"with --validation every_epoch: validate every N epochs (default {cfg.val_interval})",
    )


def add_model_options(p: argparse.ArgumentParser, race: bool, sized: bool = False) -> None:
    """Network size, patch and batch options (``race``: a race's too; ``sized``: defaults by device, `demo_scale()`)."""
    cfg = RecipeConfig()
    cuda = demo_scale(torch.device("cuda")).overrides if sized else {}

    def default(name: str) -> str:
        on_cuda = f"; on CUDA {_spaced(cuda[name])}" if name in cuda else ""
        return f"(default {_spaced(getattr(cfg, name))}{on_cuda})"

    g = p.add_argument_group("model and batches")
    g.add_argument(
        "--patch-size", type=int, help=f"training patch / sliding-window ROI {default('patch_size')}", **_XYZ
    )
    if race:
        g.add_argument(
            "--batch-size", type=int, help="volumes per batch (default: the recipe's own; fast 1, the others 2)"
        )
    g.add_argument(
        "--num-samples", type=int, help="random crops per volume (default: the recipe's own; fast 2, the others 4)"
    )
    g.add_argument("--channels", type=int, nargs="+", help=f"UNet channels per level {default('channels')}")
    if race:
        g.add_argument("--workers", type=int, help="DataLoader worker processes of the baseline (default min(4, CPUs))")
    g.add_argument(
        "--precision",
        choices=REQUESTS,
        default=cfg.precision,
        help="mixed precision (default %(default)s): auto (fast picks bf16/fp16 where it pays, measured on a CPU; "
        "monai_tutorial runs MONAI's fp16 amp on CUDA; baseline fp32), bf16, fp16 (CUDA) or fp32 (none in any recipe)",
    )
    if race:
        g.add_argument("--compile", action="store_true", help="torch.compile the network (slower first iterations)")
        g.add_argument("--cache", choices=CACHE_CHOICES, help=_HELP["--cache"])
        g.add_argument("--cache-dir", help="folder for a disk cache (needed by --cache disk)")


def add_tuning_options(p: argparse.ArgumentParser, race: bool) -> None:
    """The tuner's search options (``race``: with the ``--tune`` switch)."""
    g = p.add_argument_group("auto-tuning" + (" (with --tune)" if race else ""))
    if race:
        g.add_argument("--tune", action="store_true", help=_HELP["--tune"])
    range_ = {"nargs": 2, "metavar": ("LO", "HI")}
    cap = "the GPU's memory; on a CPU, this process's RAM plus what is free"
    add_options(
        g,
        (
            ("--batch-range", int, (1, 8), "training batch sizes (volumes) to search (default %(default)s)", range_),
            ("--sw-range", int, (1, 16), "sliding-window batch sizes to search (default %(default)s)", range_),
            ("--trials", int, 8, "most candidates run per search (default %(default)s)"),
            ("--memory-cap-mib", float, None, f"most memory a candidate may use (default: {cap})"),
            ("--margin", float, 0.1, "share of the cap kept free for the data cache and spikes (default %(default)s)"),
        ),
    )
    g.add_argument("--search-amp", action="store_true", help="also compare fp32 with the automatic mixed precision")
    g.add_argument("--place-cache", action="store_true", help=_HELP["--place-cache"])
    g.add_argument("--cache-tradeoff", type=float, default=0.05, help=_HELP["--cache-tradeoff"])
    g.add_argument("--retune", action="store_true", help="tune again even when the cache holds a result")
    g.add_argument("--tune-cache", help=_HELP["--tune-cache"])


def add_race_options(
    p: argparse.ArgumentParser, budget: float | None, recipes: Sequence[str], sized: bool = False
) -> None:
    """Every option of a race (``demo``, ``bench``), with these default budget and recipes (``sized``: see above)."""
    from monai_fast.apps.recipes import RECIPES

    add_data_options(p)
    g = p.add_argument_group("race")
    recipe_list = {"nargs": "+", "choices": RECIPES}
    add_options(
        g,
        (
            ("--recipes", None, list(recipes), "recipes to run, in this order (default %(default)s)", recipe_list),
            ("--target", float, 0.9, "validation mean Dice (no background) to reach, in (0, 1] (default %(default)s)"),
            ("--time-budget", float, budget, _HELP["--time-budget"]),
            ("--max-epochs", int, 200, "epoch limit per recipe (default %(default)s)"),
        ),
    )
    add_validation_options(g)
    g.add_argument("--background-fill", action="store_true", help=_HELP["--background-fill"])
    add_model_options(p, race=True, sized=sized)
    add_tuning_options(p, race=True)
    g = p.add_argument_group("output")
    g.add_argument("--run-dir", help=_HELP["--run-dir"])
    g.add_argument("--no-progress", action="store_true", help="no progress bars (for logs and CI)")


def recipe_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `RecipeConfig` fields that the parsed options ``args`` set."""
    kw: dict[str, Any] = {
        name: getattr(args, name)
        for name in ("max_epochs", "val_interval", "batch_size", "num_samples", "validation")
        if getattr(args, name, None) is not None
    }
    if getattr(args, "background_fill", False):
        kw["background_fill"] = True
    if args.patch_size:
        kw["patch_size"] = tuple(args.patch_size)
    if args.channels:
        kw.update(channels=tuple(args.channels), strides=(2,) * (len(args.channels) - 1))
    for name, field in (("workers", "num_workers"), ("cache", "cache"), ("cache_dir", "cache_dir")):
        if getattr(args, name, None) is not None:
            kw[field] = getattr(args, name)
    if getattr(args, "precision", None) not in (None, RecipeConfig().precision):
        kw["precision"] = args.precision
    kw["compile"] = getattr(args, "compile", False)
    return kw


def scaled_options(args: argparse.Namespace, scale: DemoScale | None = None) -> tuple[SyntheticData, dict[str, Any]]:
    """The synthetic set and recipe options of ``args``, ``scale``'s where they set none (``None``: CPU-sized ones)."""
    scale = scale or demo_scale(torch.device("cpu"))
    syn = SyntheticData(
        cases=scale.synthetic.cases if args.cases is None else args.cases,
        shape=scale.synthetic.shape if args.shape is None else tuple(args.shape),
    )
    base = dict(scale.overrides)
    if args.channels:
        for name in ("channels", "strides", "num_res_units"):
            base.pop(name, None)
    return syn, {**base, **recipe_overrides(args)}
