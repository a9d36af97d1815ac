"""What a race is asked to do (`RaceSpec`), `plan_race()`, which checks every option before anything runs, and
`size_line()`, the line the demo prints on its size."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monai_fast.apps.recipes import RECIPES, RecipeConfig
from monai_fast.apps.training.data import VAL_FRACTION, DemoScale, SyntheticData
from monai_fast.apps.training.options import (
    OptionError,
    check_precision,
    check_run_numbers,
    check_synthetic,
    check_writable_dir,
    recipe_config,
    resolve_device,
)

__all__ = [
    "DEMO_EPOCH_MULTIPLE",
    "DEMO_TOTAL_BUDGET_S",
    "TIME_BUDGET_S",
    "OptionError",
    "RacePlan",
    "RaceSpec",
    "SyntheticData",
    "TuneOptions",
    "plan_race",
    "size_line",
]

#: seconds on each recipe's own clock before it is stopped, unless a race sets another cap
TIME_BUDGET_S = 1200.0
#: the demo's whole wall clock by default: data, set-up, both recipes' training and the reports
DEMO_TOTAL_BUDGET_S = 600.0
#: the demo's epoch budget of the baseline by default, in multiples of fast's epochs to target
DEMO_EPOCH_MULTIPLE = 4.0


@dataclass(frozen=True)
class TuneOptions:
    """How the ``fast`` recipe is tuned before the race (see `monai_fast.apps.recipes.tuning.tune_recipe()`)."""

    batch_range: tuple[int, int] = (1, 8)
    sw_range: tuple[int, int] = (1, 16)
    trials: int = 8
    margin: float = 0.1
    search_amp: bool = False
    memory_cap_mib: float | None = None
    place_cache: bool = False
    cache_tradeoff: float = 0.05
    retune: bool = False
    store: str | os.PathLike | None = None


@dataclass(frozen=True)
class RaceSpec:
    """A race's options; docs/demo.md describes the budgets.

    Attributes:
        recipes: recipe names (`RECIPES`), raced in this order.
        data_dir, train_files, val_files: an MSD-layout folder, or ``{"image", "label"}`` dicts;
            with neither, ``synthetic`` data is generated.
        val_fraction: share of ``data_dir``'s cases held out for validation.
        seed, train_seed: seed of the data and split (and weights and crops unless ``train_seed``).
        target: validation mean Dice (background excluded) to reach, in (0, 1].
        time_budget_s: seconds each recipe may run; ``None``: no limit but ``max_epochs``.
        total_budget_s: seconds the whole race may take (needs ``interleave``); ``None``: no bound.
        budget_multiple, epoch_multiple: the other recipes get this many times ``fast``'s time, or
            epochs, to target (what it ran when it missed); ``None``: no such limit.
        interleave: train the recipes an epoch at a time, the one whose clock is behind next.
        device: ``"auto"`` (CUDA if present), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        overrides, tune: `RecipeConfig` fields set for every recipe; tune ``fast`` first with these options.
        run_dir: the run folder; ``None``: ``runs/race-<time>``.
        progress, preflight: progress bars; check every file of the data before training (`preflight()`).
        record_options: what ``results.json`` records under ``options``.
    """

    recipes: Sequence[str] = ("fast", "baseline")
    data_dir: str | os.PathLike | None = None
    train_files: Sequence[dict] | None = None
    val_files: Sequence[dict] | None = None
    synthetic: SyntheticData = field(default_factory=SyntheticData)
    val_fraction: float = VAL_FRACTION
    seed: int = 0
    train_seed: int | None = None
    target: float = 0.9
    time_budget_s: float | None = TIME_BUDGET_S
    total_budget_s: float | None = None
    budget_multiple: float | None = None
    epoch_multiple: float | None = None
    interleave: bool = False
    device: str = "auto"
    overrides: Mapping[str, Any] = field(default_factory=dict)
    tune: TuneOptions | None = None
    run_dir: str | os.PathLike | None = None
    progress: bool = True
    preflight: bool = True
    record_options: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RacePlan:
    """A checked `RaceSpec`: the device resolved, the recipe options built, the run folder made."""

    spec: RaceSpec
    device: str
    config: RecipeConfig
    run_dir: Path | None
    space: Any = None  # monai_fast.tune.SearchSpace when spec.tune is set


def _check_numbers(spec: RaceSpec) -> None:
    check_run_numbers(spec.target, spec.time_budget_s, spec.val_fraction)
    for name, none_is, why in (
        ("total_budget_s", "None for no bound", "the recipes share the time in turns"),
        ("budget_multiple", "None", "the lead's time to target sets the others' budget"),
        ("epoch_multiple", "None", "the lead's epochs to target sets the others' budget"),
    ):
        value = getattr(spec, name)
        if value is not None and not value > 0:
            raise OptionError(name, f"must be > 0 (or {none_is}), got {value}")
        if value is not None and not spec.interleave:
            raise OptionError(name, f"needs interleave=True ({why})")


def _check_recipes(recipes: Sequence[str]) -> None:
    if isinstance(recipes, str) or not recipes:
        raise OptionError("recipes", f"need a non-empty list of recipe names from {list(RECIPES)}, got {recipes!r}")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise OptionError("recipes", f"unknown recipe(s) {unknown}; known: {list(RECIPES)}")
    if len(set(recipes)) != len(recipes):
        raise OptionError("recipes", f"each recipe may race once (one run folder each), got {list(recipes)}")


def _check_data(spec: RaceSpec) -> None:
    lists = (spec.train_files is not None, spec.val_files is not None)
    if any(lists) and not all(lists):
        raise OptionError("train_files" if lists[1] else "val_files", "give train_files and val_files together")
    if all(lists) and spec.data_dir is not None:
        raise OptionError("data_dir", "give either data_dir or train_files/val_files, not both")
    if all(lists) and not (spec.train_files and spec.val_files):
        raise OptionError("train_files", "train_files and val_files must not be empty")
    if spec.data_dir is None and not all(lists):
        check_synthetic(spec.synthetic.kind, spec.synthetic.cases, spec.synthetic.shape)


def _search_space(options: TuneOptions, config: RecipeConfig, device: str):
    from monai_fast.apps.recipes.tuning import default_space

    try:
        return default_space(
            device,
            search_amp=options.search_amp,
            precision=config.precision,
            batch_range=tuple(options.batch_range),
            sw_batch_range=tuple(options.sw_range),
            max_trials=options.trials,
            margin=options.margin,
        )
    except (TypeError, ValueError) as e:
        raise OptionError("tune", str(e)) from e


def plan_race(spec: RaceSpec, need_run_dir: bool = True) -> RacePlan:
    """Check every option of ``spec`` before anything is trained; make the run folder; return the `RacePlan`.

    Args:
        spec: the race's options.
        need_run_dir: check (and create) the run folder; ``False`` for tuning alone.

    Raises:
        OptionError: naming the first bad option.
    """
    _check_recipes(spec.recipes)
    _check_numbers(spec)
    _check_data(spec)
    device = resolve_device(spec.device)
    config = recipe_config(spec.overrides, spec.seed if spec.train_seed is None else spec.train_seed)
    check_precision(config, device)
    space = None if spec.tune is None or "fast" not in spec.recipes else _search_space(spec.tune, config, device)
    run_dir = None
    if need_run_dir:
        run_dir = Path(f"runs/race-{dt.datetime.now():%Y%m%d-%H%M%S}" if spec.run_dir is None else spec.run_dir)
        check_writable_dir(run_dir, "run_dir")
    return RacePlan(spec=spec, device=device, config=config, run_dir=run_dir, space=space)


def size_line(spec: RaceSpec, scale: DemoScale) -> str:
    """The one line the demo prints on its size: the data, patch and network it will train, and ``scale``'s default."""
    config = recipe_config(spec.overrides, spec.seed)
    if spec.data_dir is not None or spec.train_files is not None:
        data = f"data from {spec.data_dir or 'the given file lists'}"
    else:
        data = f"{spec.synthetic.cases} synthetic volumes of {'x'.join(map(str, spec.synthetic.shape))} voxels"
    return (
        f"sized for {scale.device} (default: {scale.name}): {data}, {'x'.join(map(str, config.patch_size))} patches, "
        f"UNet {'-'.join(map(str, config.channels))} with {config.num_res_units} residual unit(s); "
        "--cases, --shape, --patch-size, --channels change it"
    )
