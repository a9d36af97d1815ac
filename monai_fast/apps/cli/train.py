"""``monai-fast train``: train one recipe from hyperparameters, the SageMaker training toolkit's way when it is there.

Inside a SageMaker training container the defaults come from the job (the command line wins); on several
hosts each starts this command under torchrun (docs/sagemaker-s3.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import re
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from monai_fast.apps.cli import add_options
from monai_fast.apps.cli.args import add_data_options, add_model_options, add_validation_options, scaled_options
from monai_fast.apps.launch.sagemaker import SageMakerEnv, SageMakerEnvError, read_sagemaker_env, torchrun_command
from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.recipes.config import NETWORKS, OPTIMIZERS
from monai_fast.apps.training.job import TrainJob, TrainOutcome
from monai_fast.handlers.preemption import STOPPED_EXIT, end_of_setup, stop_signals_caught

__all__ = ["add_train_command", "hyperparameter_values"]

logger = logging.getLogger("monai_fast")

_TEXT = (
    "Train one recipe (default fast) on an MSD-layout folder (--data-dir; default: synthetic spleen-like data) until "
    "--max-epochs, --target or --time-budget; write the final model (model.pth, which monai-fast infer reads, and "
    "recipe.json) into --model-dir, and the run record, the doctor's report, results and plots into --output-dir. In a "
    "SageMaker training job (any SM_* variable set) the defaults come from the job: its input channel "
    "(SM_CHANNEL_<NAME>; never synthetic data), SM_MODEL_DIR, SM_OUTPUT_DATA_DIR, SM_NUM_GPUS, and its hyperparameters "
    "(SM_HPS or hyperparameters.json) set any option below by name; the command line wins. With several hosts "
    "(SM_HOSTS) each host runs this command under torchrun (docs/sagemaker-s3.md)."
)

_HELP = "train one recipe and save the model; SageMaker's channels, model dir and hyperparameters when present"

OUTPUT_FAILED_EXIT = 1  #: exit status of a run whose model was saved but another output could not be written
_JOB = {f.name: f.default for f in fields(TrainJob)}  # the job's defaults, shown as the options'
_EVERY = "(default %(default)s: run every epoch)"


_FOLDERS = {
    "--output-dir": "run record, report, results and plots (default $SM_OUTPUT_DATA_DIR, else runs/train-<time>)",
    "--model-dir": "the final model.pth and recipe.json (default $SM_MODEL_DIR, else <output-dir>/model)",
    "--tensorboard-dir": "also write TensorBoard loss and Dice here (default in SageMaker: $SM_OUTPUT_DIR/tensorboard, "
    "where its TensorBoardOutputConfig collects them; else only <output-dir>/<recipe>)",
    "--checkpoint-dir": "make the run preemption-safe: on SIGTERM/SIGUSR1 (a spot reclaim, scancel) finish the "
    "iteration, checkpoint here and exit 143; the same command resumes from here (default in SageMaker: "
    "/opt/ml/checkpoints when the job has checkpointing configured)",
}


def _train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``train`` option to ``parser`` (the sub-command's, or a stand-alone one for hyperparameters)."""
    from monai_fast.apps.recipes import RECIPES

    cfg = RecipeConfig()
    add_data_options(parser)
    g = parser.add_argument_group("training")
    channel = "SM_CHANNEL_<NAME>; default: the job's only channel, else 'training'"
    network = f"MONAI's UNet or SegResNet (init_filters = the first of --channels) (default {cfg.network})"
    add_options(
        g,
        (
            ("--channel", None, None, f"in a SageMaker job: the input channel to train on (its folder is {channel})"),
            ("--recipe", None, _JOB["recipe"], "the recipe to train (default %(default)s)", {"choices": RECIPES}),
            ("--network", None, None, network, {"choices": NETWORKS}),
            ("--dropout", float, None, f"dropout probability of the network (default {cfg.dropout})"),
            ("--optimizer", None, None, "default: the recipe's own (fast: adamw)", {"choices": OPTIMIZERS}),
        ),
    )
    g.add_argument("--lr", "--learning-rate", type=float, help="learning rate (default: the optimizer's default here)")
    g.add_argument("--max-epochs", "--epochs", type=int, help=f"epochs to train (default {cfg.max_epochs})")
    add_options(
        g,
        (
            ("--target", float, _JOB["target"], "stop once validation mean Dice reaches this, in (0, 1] " + _EVERY),
            ("--time-budget", float, None, "stop after this many seconds (default: no limit)"),
        ),
    )
    add_validation_options(g)
    add_model_options(parser, race=True, sized=True)
    g = parser.add_argument_group("output")
    for flag, text in _FOLDERS.items():
        g.add_argument(flag, help=text)
    save_every = "with a checkpoint folder, also checkpoint every N iterations, so a crash loses at most N"
    g.add_argument("--save-every", type=int, help=f"{save_every} (default: only on a signal)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")
    return parser


def _hp_tokens(name: str, value: Any) -> list[str]:
    """``--name value...`` for one hyperparameter (a list, or a string of numbers, gives several values)."""
    flag = "--" + name.lstrip("-").replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else []
    if isinstance(value, list):
        return [flag, *(str(v) for v in value)]
    if isinstance(value, str) and re.fullmatch(r"\s*-?[\d.]+([\s,]+-?[\d.]+)+\s*", value):
        return [flag, *re.split(r"[\s,]+", value.strip())]
    return [flag, str(value)]


def hyperparameter_values(hyperparameters: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``train`` options that ``hyperparameters`` set, by destination name; one error naming a bad one.

    Keys SageMaker adds for its own use (``sagemaker_*``) and ``None`` values are skipped; ``source`` names
    where they came from in the `SystemExit` that refuses a bad one.

    Example:
        >>> hyperparameter_values({"epochs": 2, "patch_size": "32 32 32"}, "SM_HPS")
        {'max_epochs': 2, 'patch_size': [32, 32, 32]}
    """
    parser = _train_parser(
        argparse.ArgumentParser(prog="monai-fast train", exit_on_error=False, add_help=False, allow_abbrev=False)
    )
    defaults = vars(parser.parse_args([]))
    values: dict[str, Any] = {}
    for name, value in hyperparameters.items():
        if name.startswith("sagemaker_") or value is None:
            continue
        where = f"monai-fast train: hyperparameter {name!r} (from {source})"
        try:
            parsed, extra = parser.parse_known_args(_hp_tokens(name, value))
        except argparse.ArgumentError as e:
            raise SystemExit(f"{where}: {e}") from None
        if extra:
            why = (
                "is not an option of monai-fast train"
                if extra[0].startswith("--")
                else f"takes no value, got {value!r}"
            )
            raise SystemExit(f"{where}: {why} (see monai-fast train --help)")
        values.update({k: v for k, v in vars(parsed).items() if v != defaults[k]})
    return values


def _merged(args: argparse.Namespace, sm: SageMakerEnv) -> argparse.Namespace:
    """``args`` with the job's hyperparameters and directories as defaults (what the command line set wins)."""
    defaults = vars(_train_parser(argparse.ArgumentParser(add_help=False)).parse_args([]))
    given = {k: v for k, v in vars(args).items() if k in defaults and v != defaults[k]}
    merged = {**vars(args), **hyperparameter_values(sm.hyperparameters, sm.hyperparameters_from), **given}
    if sm.present and merged.get("data_dir") is None:
        try:
            merged["data_dir"] = str(sm.channel_dir(merged.get("channel")))
        except SageMakerEnvError as e:
            read = ", ".join(sm.variables) or "hyperparameters.json"
            raise SystemExit(f"monai-fast train: SageMaker job (read: {read}): {e}; or give --data-dir") from None
    elif merged.get("channel") is not None and not sm.present:
        raise SystemExit(
            f"monai-fast train: --channel {merged['channel']} names a SageMaker input channel, but no "
            "SageMaker variable (SM_*) is set; give --data-dir"
        )
    if merged.get("device") == "auto" and sm.num_gpus == 0:
        merged["device"] = "cpu"
    return argparse.Namespace(**merged)


def _job(args: argparse.Namespace, sm: SageMakerEnv) -> TrainJob:
    """The `TrainJob` of the merged ``args``: the job's folders, data and network sized for the device, where unset."""
    import torch

    from monai_fast.apps.training.data import demo_scale
    from monai_fast.apps.training.options import resolve_device
    from monai_fast.extras import available, require

    output = Path(args.output_dir or sm.output_data_dir or f"runs/train-{dt.datetime.now():%Y%m%d-%H%M%S}")
    tensorboard = args.tensorboard_dir or sm.tensorboard_dir
    if args.tensorboard_dir:  # asked for: checked before any data is read
        require("tensorboard", extra="plots", feature="train --tensorboard-dir")
    elif tensorboard and not available("tensorboard"):  # SageMaker's own folder, not asked for: a by-product
        logger.warning("SageMaker's TensorBoard folder is left empty: tensorboard is not installed (the plots extra)")
        tensorboard = None
    synthetic, overrides = scaled_options(args, demo_scale(torch.device(resolve_device(args.device))))
    chosen = {k: getattr(args, k) for k in ("network", "dropout", "optimizer", "lr") if getattr(args, k) is not None}
    return TrainJob(
        recipe=args.recipe,
        output_dir=output,
        model_dir=args.model_dir or sm.model_dir or output / "model",
        data_dir=args.data_dir,
        synthetic=synthetic,
        val_fraction=args.val_fraction,
        seed=args.seed,
        preflight=not args.no_preflight,
        overrides={**overrides, **chosen},
        device=args.device,
        target=args.target,
        time_budget_s=args.time_budget,
        progress=not args.no_progress,
        tensorboard_dir=tensorboard or None,
        checkpoint_dir=args.checkpoint_dir or sm.checkpoint_dir or None,
        save_every=args.save_every,
        record_options={k: v for k, v in vars(args).items() if k != "func"},
    )


def _train_rank(local_rank: int, job: TrainJob) -> None:
    from monai_fast.apps.training.job import train_job

    _print_outcome(train_job(job), job)


def _print_outcome(outcome: TrainOutcome, job: TrainJob) -> None:
    """Print ``outcome``; a stopped run exits `STOPPED_EXIT`, one with an output not written `OUTPUT_FAILED_EXIT`."""
    if outcome.stopped is not None:
        if outcome.lead:
            print(outcome.stopped, flush=True)
        raise SystemExit(STOPPED_EXIT)
    for line in outcome.failed:
        print(f"monai-fast train: not written: {line}", file=sys.stderr, flush=True)
    result = outcome.result
    if not outcome.lead or result is None:
        return
    dice = "none" if result.best_dice is None else f"{result.best_dice:.3f}"
    print(
        f"trained {result.recipe} ({outcome.network}) for {result.epochs_run} epochs in {result.total_s:.1f} s "
        f"on {result.device}: best validation Dice {dice}",
        flush=True,
    )
    if result.diagnosis:
        print(
            f"doctor: {result.diagnosis['verdict']}: {result.diagnosis['evidence'][0]}  "
            f"(report: {outcome.report or 'not written'})"
        )
    print(f"model: {outcome.model or 'not written'}\nresults: {outcome.results or 'not written'}")
    if job.tensorboard_dir:
        print(f"tensorboard --logdir {job.tensorboard_dir}")
    if outcome.failed:
        raise SystemExit(OUTPUT_FAILED_EXIT)


@stop_signals_caught()  # a signal while the job is read, the data checked or cached: kept
def _cmd_train(args: argparse.Namespace) -> int:
    from monai_fast.apps.launch import run
    from monai_fast.apps.launch.supervise import supervise
    from monai_fast.distributed import detect
    from monai_fast.distributed.env import LAUNCHED_BY

    try:
        sm = read_sagemaker_env()
    except SageMakerEnvError as e:
        raise SystemExit(f"monai-fast train: SageMaker environment: {e}") from e
    if sm.present:
        logger.info("SageMaker job: %s", sm.describe())
    args = _merged(args, sm)
    if len(sm.hosts) > 1 and detect().launcher == "none":  # this host's share: this command line under torchrun
        end_of_setup()  # the launcher passes signals on to the ranks from here
        cmd = torchrun_command(sm, ["-m", "monai_fast.apps.cli", *sys.argv[1:]])  # rendezvous on the first host
        print("launching: " + " ".join(cmd), flush=True)
        return supervise(cmd, grace_s=120.0, env={**os.environ, LAUNCHED_BY: str(len(sm.hosts))})
    job = _job(args, sm)  # every option checked before any process starts or any data is read
    run(_train_rank, job, seed=args.seed)
    return 0


def add_train_command(sub: argparse._SubParsersAction) -> None:
    """Add ``train`` to the sub-command parsers ``sub``."""
    _train_parser(sub.add_parser("train", description=_TEXT, help=_HELP)).set_defaults(func=_cmd_train, tune=False)
