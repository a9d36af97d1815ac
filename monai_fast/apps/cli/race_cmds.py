"""``monai-fast demo | bench | tune``: parse, call `monai_fast.apps.demo` (``tune --bundle``: the bundle tuner), print.

A stop signal (``SIGTERM``, ``SIGUSR1``) during a race's set-up stops the command when training would start,
with one line and exit status 143 (`STOPPED_EXIT`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from monai_fast.apps.cli import add_options
from monai_fast.apps.cli.args import (
    add_data_options,
    add_model_options,
    add_race_options,
    add_tuning_options,
    scaled_options,
)
from monai_fast.apps.demo import RaceEvents, RaceRun, RaceSpec, TuneOptions, bench, race, tune_only
from monai_fast.apps.demo.options import DEMO_EPOCH_MULTIPLE, DEMO_TOTAL_BUDGET_S, TIME_BUDGET_S, size_line
from monai_fast.apps.training.data import DemoScale, demo_scale
from monai_fast.apps.training.options import resolve_device
from monai_fast.apps.training.run import TrainResult
from monai_fast.handlers.preemption import stop_signals_caught

__all__ = ["ProgressPrinter", "add_race_commands", "add_tune_command", "race_spec"]


class ProgressPrinter(RaceEvents):
    """Prints a race's steps as they happen (``table``: also each race's table, as ``bench`` does)."""

    def __init__(self, table: bool = False) -> None:
        self.table = table

    def repeat_started(self, index: int, repeats: int) -> None:
        print(f"== repeat {index}/{repeats}", flush=True)

    def tuned(self, tuning) -> None:
        where = tuning.cache_where
        cache = "" if where is None else f", cache {where} ({tuning.cache_budget_mib:.0f} MiB left for it)"
        how = f"tuning took {tuning.tuning_s:.1f} s, not counted below"
        how = "from the tuning cache" if tuning.from_cache else how
        print(
            f"-- tuned fast: batch_size={tuning.batch_size}, sw_batch_size={tuning.sw_batch_size}, "
            f"val_device={tuning.val_device}, precision={tuning.precision}{cache} ({how})",
            flush=True,
        )

    def recipe_started(self, recipe: str, target: float, time_budget_s: float | None) -> None:
        budget = "none" if time_budget_s is None else f"{time_budget_s:.0f} s"
        print(f"-- {recipe}: training to Dice {target} (budget {budget})", flush=True)

    def budget_set(self, recipe: str, time_budget_s: float, how: dict) -> None:
        print(f"-- {recipe}: {budget_text(time_budget_s, how)}", flush=True)

    def time_shared(self, recipe: str, time_budget_s: float, left_s: float) -> None:
        print(
            f"-- {recipe}: up to {time_budget_s:.0f} s on its own clock (set-up included): its share of the "
            f"{left_s:.0f} s left after the set-up, the others training as long beside it",
            flush=True,
        )

    def recipe_finished(self, r: TrainResult) -> None:
        state = f"reached in {r.time_to_target_s:.1f} s" if r.reached else f"not reached in {r.total_s:.0f} s"
        print(f"   {r.recipe}: {state}, best Dice {r.best_dice or 0:.3f}, {r.epochs_run} epochs", flush=True)

    def race_finished(self, run: RaceRun) -> None:
        if self.table:
            from monai_fast.apps.demo.core import format_table

            print(format_table(run.results), flush=True)


def _tune_options(args: argparse.Namespace) -> TuneOptions:
    """The `TuneOptions` of the parsed options: each field is the option of its name (``store``: --tune-cache)."""
    options = {f.name: getattr(args, f.name) for f in fields(TuneOptions) if f.name != "store"}
    options.update(batch_range=tuple(args.batch_range), sw_range=tuple(args.sw_range))
    return TuneOptions(**options, store=args.tune_cache)


def race_spec(args: argparse.Namespace, run_dir: str | None = None, scale: DemoScale | None = None) -> RaceSpec:
    """The `RaceSpec` of a parsed ``demo``, ``bench`` or ``tune`` command line, in ``run_dir``.

    ``scale`` gives the defaults for the options left unset (the demo's `demo_scale()`; ``None``: CPU-sized ones).
    """
    synthetic, overrides = scaled_options(args, scale)
    return RaceSpec(
        recipes=getattr(args, "recipes", ("fast",)),
        data_dir=args.data_dir,
        synthetic=synthetic,
        val_fraction=args.val_fraction,
        seed=args.seed,
        target=getattr(args, "target", 0.9),
        time_budget_s=getattr(args, "time_budget", None),
        budget_multiple=getattr(args, "budget_multiple", None),
        epoch_multiple=getattr(args, "epoch_multiple", None) or None,  # 0: no epoch budget
        interleave=getattr(args, "interleave", False),
        device=args.device,
        overrides=overrides,
        tune=_tune_options(args) if getattr(args, "tune", True) else None,  # the tune command always tunes
        run_dir=run_dir,
        progress=not args.no_progress,
        preflight=not args.no_preflight,
        record_options={k: v for k, v in vars(args).items() if k != "func"},
    )


@stop_signals_caught()  # a signal while the data are written or cached, or the recipes built: kept
def _cmd_demo(args: argparse.Namespace) -> int:
    from monai_fast.apps.demo.headline import format_headline
    from monai_fast.extras import require

    for module in ("matplotlib", "tensorboard"):  # before any data are written or any recipe trains
        require(module, extra="plots", feature="the demo (its Dice-vs-time PNG and TensorBoard events)")
    scale = demo_scale(torch.device(resolve_device(args.device)))
    spec = race_spec(args, args.run_dir or f"runs/demo-{dt.datetime.now():%Y%m%d-%H%M%S}", scale)
    if not args.total_budget >= 0:
        raise SystemExit(f"monai-fast demo: --total-budget must be >= 0 seconds (0: no bound), got {args.total_budget}")
    spec = replace(spec, total_budget_s=args.total_budget or None)  # 0: no bound
    for line in filter(None, (size_line(spec, scale), budget_line(spec), time_line(spec))):
        print(line, flush=True)
    run = race(spec, ProgressPrinter())
    print()
    print(format_headline(run.meta["headline"]))
    for r in run.results:
        if r.diagnosis:
            print(
                f"doctor, {r.recipe}: {r.diagnosis['verdict']}: {r.diagnosis['evidence'][0]}; "
                f"next: {r.diagnosis['fixes'][0]}  (report: {r.run_dir}/report.md)"
            )
    print(f"\nrun folder: {run.run_dir}  (results.json, epochs.csv, dice_vs_time.png, TensorBoard events per recipe)")
    print(f"tensorboard --logdir {run.run_dir}")
    return 0


def budget_line(spec: RaceSpec) -> str:
    """The line the demo prints before it starts: how long each recipe may run, and how to change it.

    Example: ``budget: fast up to 600 s; baseline 5x fast's epochs to target, at most 600 s, at most 100 epochs
    (--max-epochs) (--epoch-multiple, --budget-multiple, --time-budget); epochs interleaved``.
    """
    from monai_fast.apps.demo.interleave import lead_of
    from monai_fast.apps.training.options import recipe_config

    lead = lead_of(spec.recipes)
    cap = "no cap" if spec.time_budget_s is None else f"at most {spec.time_budget_s:.0f} s"
    others = ", ".join(r for r in spec.recipes if r != lead)
    if spec.time_budget_s is not None:
        lead_part = f"{lead} up to {spec.time_budget_s:.0f} s"
    else:
        n = len(spec.recipes)  # the lead's share under a total bound (`monai_fast.apps.demo.interleave.lead_share()`)
        share = {1: "half", 2: "a third", 3: "a quarter"}.get(n, f"1/{n + 1}")
        lead_part = (
            f"{lead} up to {share} of the time left after the set-up" if spec.total_budget_s else f"{lead} no limit"
        )
    max_epochs = recipe_config(spec.overrides, spec.seed).max_epochs
    multiples = ((spec.epoch_multiple, "epochs"), (spec.budget_multiple, "time"))
    rules = [f"{m:g}x {lead}'s {what} to target" for m, what in multiples if m]
    if spec.total_budget_s:
        rule = ", ".join([*rules, *([cap] if spec.time_budget_s is not None else [])]) + ", or until the time is up"
        rule = rule.lstrip(", ")
    else:
        rule = f"{' and '.join(rules)}, {cap}" if rules else cap
    if spec.epoch_multiple:
        rule += f", at most {max_epochs} epochs (--max-epochs)"
    flags = "--epoch-multiple, --budget-multiple, --time-budget" + (", --total-budget" if spec.total_budget_s else "")
    return (
        f"budget: {lead_part}"
        + (f"; {others} {rule}" if others else "")
        + f" ({flags})"
        + ("; epochs interleaved" if spec.interleave else "")
    )


def time_line(spec: RaceSpec) -> str | None:
    """The line that says up front how long the demo takes at most (``None`` without a total bound)."""
    if not spec.total_budget_s:
        return None
    minutes, rest = divmod(round(spec.total_budget_s), 60)  # "10 min", "4 min 30 s", "45 s"
    spoken = (f"{minutes} min" + (f" {rest} s" if rest else "")) if minutes else f"{rest} s"
    return (
        f"time: at most {spoken} ({spec.total_budget_s:.0f} s) from here on any machine: data, set-up, training of "
        f"{' and '.join(spec.recipes)}, reports (--total-budget)"
    )


def budget_text(time_budget_s: float, how: dict) -> str:
    """What a recipe other than the lead got once the lead was done: its epochs and its seconds, and from what.

    Example: ``budget 40 epochs (fast reached the target in 8 epochs, 20.0 s; 5x its epochs), at most 600 s on
    its own clock``.
    """
    lead, ran = how["lead"], f"{how['lead_epochs']} epochs, {how['lead_s']:.1f} s"
    done = f"reached the target in {ran}" if how["lead_reached"] else f"ran {ran} without reaching it"
    rules = [f"{how['epoch_multiple']:g}x its epochs"] if how.get("others_epochs") else []
    if how.get("epoch_multiple") and not how.get("others_epochs") and how["lead_epochs"] < 1:
        rules.append("no epoch budget without one of its epochs")
    rules += [f"{how['multiple']:g}x its time"] if how.get("multiple") else []
    if how.get("max_epochs") and how.get("others_epochs"):
        wanted = math.ceil(how["epoch_multiple"] * how["lead_epochs"])
        rules[0] += f" = {wanted}, capped by --max-epochs {how['max_epochs']}"
    cap = "no cap" if how["time_budget_s"] is None else f"at most {how['time_budget_s']:.0f} s"
    epochs = f"{how['others_epochs']} epochs" if how.get("others_epochs") else f"{time_budget_s:.0f} s"
    limited = how.get("multiple") or how.get("others_epochs") or how.get("total_budget_left_s") is not None
    seconds = f"at most {time_budget_s:.0f} s" if limited else cap
    if how.get("total_budget_left_s") is not None:
        seconds += f" ({how['total_budget_left_s']:.0f} s left of --total-budget)"
    return f"budget {epochs} ({lead} {done}; {', '.join(rules) or cap}), {seconds} on its own clock"


@stop_signals_caught()  # a signal while the data are written or cached, or the recipes built: kept
def _cmd_bench(args: argparse.Namespace) -> int:
    spec = race_spec(args, args.run_dir)
    done = bench(spec, repeats=args.repeats, out_dir=args.out, events=ProgressPrinter(table=True))
    print("\nsummary (medians over repeats):")
    print(json.dumps(done.summary, indent=2))
    print(f"\nwrote {done.path}")
    return 0


_DEMO_TEXT = (
    "Generate (once, then reuse) a synthetic spleen-like CT set in MSD layout, train the 'fast' and the 'baseline' "
    "recipe on it until validation mean Dice reaches --target or --time-budget runs out, and print time to target, "
    "epochs, train/val seconds per epoch, data-wait share and the speed-up. Writes a run folder with results.json, "
    "epochs.csv, dice_vs_time.png and TensorBoard events. The recipes train an epoch at a time in turns, so their "
    "seconds per epoch meet the same host load; fast's epochs to target then set the baseline's budget "
    "(--epoch-multiple times them). The whole demo ends within --total-budget seconds on any machine (said up front). "
    "A baseline that misses the target has its time to target estimated from its Dice curve and labelled 'estimated' "
    "(docs/demo.md). Every option is checked before training starts (an unwritable --run-dir fails at once)."
)

_DEMO_HELP = (
    "race the fast recipe against a plain-MONAI baseline to a target Dice (at most --total-budget, "
    f"{DEMO_TOTAL_BUDGET_S:.0f} s, in all)"
)
_TOTAL_BUDGET = (
    "the whole demo (data, set-up, both recipes, reports) ends within S seconds on any machine: fast trains at most a "
    "third of the time left after the set-up (the baseline as long beside it, in turns), then the baseline its epoch "
    "budget or until the time is up; 0: no bound (default %(default)g)"
)
_EPOCH_MULTIPLE = (
    "the other recipes train at most this many times fast's epochs to target (its epochs run when it missed), "
    "within --time-budget; a count of epochs, so how far their Dice curves get does not depend on the host's load; "
    "0: no epoch budget (default %(default)s)"
)
_BUDGET_MULTIPLE = (
    "also stop the other recipes after this many times fast's time to target (its time run when it missed), within "
    "--time-budget (default: no such limit)"
)
_BENCH_HELP = "time-to-Dice benchmark of all three recipes with repeats; writes JSON to benchmarks/results/"
_BENCH_TEXT = (
    "The demo's race with every recipe (baseline, monai_tutorial, fast), repeated, with a longer budget; writes one "
    "JSON with all epochs, the machine and package versions, and medians."
)


def add_race_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` and ``bench`` to the sub-command parsers ``sub``."""
    p = sub.add_parser("demo", description=_DEMO_TEXT, help=_DEMO_HELP)
    add_race_options(p, budget=None, recipes=("fast", "baseline"), sized=True)
    add_options(
        p,
        (
            ("--total-budget", float, DEMO_TOTAL_BUDGET_S, _TOTAL_BUDGET, {"metavar": "S"}),
            ("--epoch-multiple", float, DEMO_EPOCH_MULTIPLE, _EPOCH_MULTIPLE),
            ("--budget-multiple", float, None, _BUDGET_MULTIPLE),
        ),
    )
    p.set_defaults(func=_cmd_demo, interleave=True)

    p = sub.add_parser("bench", help=_BENCH_HELP, description=_BENCH_TEXT)
    add_race_options(p, budget=TIME_BUDGET_S, recipes=("baseline", "monai_tutorial", "fast"))
    add_options(
        p,
        (
            ("--repeats", int, 1, "repeats with different seeds for weights and crops (default %(default)s)"),
            ("--out", None, "benchmarks/results", "folder for the result JSON (default %(default)s)"),
        ),
    )
    p.set_defaults(func=_cmd_bench)


#: the ``tune`` options that apply with ``--bundle`` (the rest describe the fast recipe's model and data)
_BUNDLE_TUNE_OPTIONS = frozenset(
    {"bundle", "bundle_config", "set", "bundle_out", "precision", "batch_range", "sw_range", "trials"}
    | {"memory_cap_mib", "margin", "no_progress", "verbose", "subcommand", "func"}
)


def _cmd_tune_bundle(args: argparse.Namespace) -> int:
    from monai_fast.apps.cli import build_parser
    from monai_fast.bundle import BundleError, parse_overrides
    from monai_fast.bundle.tune import bundle_run_command, tune_bundle

    defaults = vars(build_parser().parse_args(["tune", "--bundle", "."]))  # recipe options given: the bundle sets those
    given = [k for k, v in vars(args).items() if k not in _BUNDLE_TUNE_OPTIONS and v != defaults.get(k, v)]
    if given:
        stray = ", ".join("--" + k.replace("_", "-") for k in given)
        raise SystemExit(
            f"monai-fast tune --bundle: {stray}: not used with --bundle (the bundle's config sets the "
            "model, data and device: change them with --set ID=VALUE; name the override file with --bundle-out)"
        )

    def say(line: str) -> None:
        tqdm.write(line)  # above the progress bar on a terminal; a plain line elsewhere
        sys.stdout.flush()

    try:
        overrides = parse_overrides(args.set)
        tuned = tune_bundle(
            args.bundle,
            config_files=args.bundle_config,
            overrides=overrides,
            out=args.bundle_out,
            precision=args.precision,
            progress=not args.no_progress,
            say=say,
            batch_range=tuple(args.batch_range),
            sw_batch_range=tuple(args.sw_range),
            max_trials=args.trials,
            memory_cap_mib=args.memory_cap_mib,
            margin=args.margin,
            new_keys=args.new_key,
        )
    except BundleError as e:
        raise SystemExit(f"monai-fast tune --bundle: {e}") from e
    print(tuned.table)
    for key, value in tuned.overrides.items():
        print(f"{key} = {value}")
    for key, why in tuned.not_written.items():
        print(f"not written: {key}: {why}")
    if tuned.layout == "auto3dseg":
        reads = tuned.path.resolve().parent == (Path(args.bundle) / "configs").resolve()
        how = (
            "every file of configs/ in name order, this one last"
            if reads
            else "only the algorithm's configs/: copy it there"
        )
        print(f"wrote {tuned.path}: Auto3DSeg reads {how}")
    else:
        print(f"wrote {tuned.path}; train with it (measured with these overrides, in {tuned.precision}):")
        print("  " + bundle_run_command(tuned, args.bundle, overrides, args.precision))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    if args.bundle:
        return _cmd_tune_bundle(args)
    tuned = tune_only(race_spec(args), out=args.out)
    print(tuned.result.table())
    if tuned.result.from_cache:
        print("(from the tuning cache; --retune to measure again)")
    print("\nuse it: monai-fast demo --tune ...   or in Python: tune_recipe(...).apply(RecipeConfig(...))")
    if tuned.path is not None:
        print(f"wrote {tuned.path}")
    return 0


_TUNE_TEXT = (
    "Search the training batch size (volumes per batch), the sliding-window batch size and where the validation output "
    "is stitched (GPU or CPU), and optionally fp32 against mixed precision and where the training cache goes "
    "(--place-cache), for the fast recipe's UNet on this device. Each candidate runs real iterations after a warm-up "
    "and is scored by patches/s (training) or volumes/s (validation) within a memory budget (cap minus margin); "
    "docs/tuner.md describes the search. Results are cached per device, memory, model, patch and volume size; "
    "'monai-fast demo --tune' applies them."
)

_BUNDLE_HELP = {
    "--bundle": "tune this bundle's training batch, sliding-window batch and stitching device for its network and "
    "patch on this device, and write an override file the bundle merges as one more config (the Model Zoo's or "
    "Auto3DSeg's keys). With it apply --set, --bundle-config, --bundle-out, --batch-range (capped by the training "
    "set), --sw-range, --trials, --memory-cap-mib, --margin and --precision (what 'monai-fast bundle run "
    "--precision' will train in; the trials run in it); it prints the plan first, a line per trial, the trials' "
    "table and the 'monai-fast bundle run' line that trains with the result and the same --set overrides",
    "--bundle-config": "the bundle's config file(s), as monai.bundle takes them (default configs/train.json; for an "
    "Auto3DSeg algorithm every file of configs/)",
    "--set": "a bundle config override, as monai.bundle takes it (repeat: --set dataset_dir=/data ...); an id the "
    "config does not have is refused, naming the nearest, unless named with --new-key",
    "--new-key": "a --set id the bundle's config does not have, added on purpose (repeatable)",
}
_TUNE_HELP = "pick fast's batch size, sliding-window batch, validation device and precision by measured throughput"


def add_tune_command(sub: argparse._SubParsersAction) -> None:
    """Add ``tune`` to the sub-command parsers ``sub``."""
    p = sub.add_parser("tune", description=_TUNE_TEXT, help=_TUNE_HELP)
    add_data_options(p)
    add_model_options(p, race=False)
    add_tuning_options(p, race=False)
    p.add_argument("--out", help="also write the result (with every trial) to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    b = p.add_argument_group("a MONAI bundle instead of a recipe")
    b.add_argument("--bundle", metavar="DIR", help=_BUNDLE_HELP["--bundle"])
    b.add_argument("--bundle-config", help=_BUNDLE_HELP["--bundle-config"])
    b.add_argument("--set", action="append", default=[], metavar="ID=VALUE", help=_BUNDLE_HELP["--set"])
    b.add_argument("--new-key", action="append", default=[], metavar="ID", help=_BUNDLE_HELP["--new-key"])
    b.add_argument("--bundle-out", help="the override file (default <DIR>/configs/tuned.json)")
    p.set_defaults(func=_cmd_tune)
