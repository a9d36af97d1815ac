"""``monai-fast tune``: the fast recipe's settings measured on this device, or a MONAI bundle's (``--bundle``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tqdm.auto import tqdm

from monai_fast.apps.cli.args import add_data_options, add_model_options, add_tuning_options
from monai_fast.apps.cli.race_cmds import race_spec
from monai_fast.apps.demo import tune_only

__all__ = ["add_tune_command"]

#: the ``tune`` options that apply with ``--bundle`` (the rest describe the fast recipe's model and data)
_BUNDLE_TUNE_OPTIONS = frozenset(
    {"bundle", "bundle_config", "set", "bundle_out", "precision", "batch_range", "sw_range", "trials"}
    | {"memory_cap_mib", "margin", "no_progress", "verbose", "subcommand", "func"}
)


def _recipe_only_options(args: argparse.Namespace) -> list[str]:
    """The recipe options given on a ``tune --bundle`` line, as typed (the bundle's config sets those)."""
    from monai_fast.apps.cli import build_parser

    defaults = vars(build_parser().parse_args(["tune", "--bundle", "."]))
    given = [k for k, v in vars(args).items() if k not in _BUNDLE_TUNE_OPTIONS and v != defaults.get(k, v)]
    return ["--" + k.replace("_", "-") for k in given]


def _cmd_tune_bundle(args: argparse.Namespace) -> int:
    from monai_fast.bundle import BundleError, parse_overrides
    from monai_fast.bundle.tune import bundle_run_command, tune_bundle

    stray = _recipe_only_options(args)
    if stray:
        raise SystemExit(
            f"monai-fast tune --bundle: {', '.join(stray)}: not used with --bundle (the bundle's config sets the "
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
