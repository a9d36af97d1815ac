"""``monai-fast train``: train one recipe from hyperparameters, the SageMaker training toolkit's way when it is there.

Outside SageMaker it is an ordinary command (``--data-dir``, ``--output-dir``, ``--model-dir``...).
Inside a SageMaker training container (:mod:`monai_fast.distributed.sagemaker` reads its variables)
the defaults come from the job: data from its input channel (the only one, the one ``--channel``
names, else ``training``; synthetic data never stand in for a missing channel there), the model's ``state_dict`` into
``SM_MODEL_DIR``, the record, report, results and plots into ``SM_OUTPUT_DATA_DIR``, TensorBoard
events where SageMaker collects them, the device from ``SM_NUM_GPUS``, and options from the job's
hyperparameters (``SM_HPS`` or ``hyperparameters.json``; a hyperparameter ``max_epochs`` or
``max-epochs`` is the option ``--max-epochs``, values as JSON or as strings). Options given on the
command line win over hyperparameters. On several hosts (``SM_HOSTS``) each host starts this same
command under torchrun, meeting at the first host.

A stop signal (``SIGTERM``, ``SIGUSR1``) is caught from the command's first line: one received
while the data are read or cached stops the run at its start, checkpointed with
``--checkpoint-dir``, and always with a message and :data:`PREEMPTED_EXIT`. The model folder's free
space is checked against the network's size before any data is read; after training the model is
written first, then the other outputs, each on its own, so that a full disk costs only the file
that did not fit (named, with the space missing) and the command exits 1; a run record that its
full file system cut short during training is named the same way, and training goes on.

One run per output folder: the command holds the folder's lock (:class:`~monai_fast.files.RunFolderLock`)
from its start to its end, so a second ``train`` into it, whatever its recipe, stops at once with one
line naming the folder and the run that holds it.

Example:
    >>> import argparse
    >>> sub = argparse.ArgumentParser(prog="monai-fast").add_subparsers(dest="command")
    >>> add_train_command(sub)
    >>> sorted(sub.choices)
    ['train']
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from monai_fast.cli.args import add_data_options, add_model_options, add_validation_options, race_spec
from monai_fast.distributed.sagemaker import SageMakerEnv, SageMakerEnvError, read_sagemaker_env, torchrun_command
from monai_fast.handlers.stop_signal import STOPPED_EXIT, end_of_setup, stop_signals_caught
from monai_fast.recipes.config import NETWORKS, OPTIMIZERS

__all__ = ["add_train_command", "hyperparameter_values"]

logger = logging.getLogger("monai_fast")

_TEXT = (
    "Train one recipe (default fast) on an MSD-layout folder (--data-dir; default: synthetic spleen-like data) until "
    "--max-epochs, --target or --time-budget; write the final model (model.pth, a checkpoint monai-fast infer reads; "
    "recipe.json to rebuild it) into --model-dir, and the run record, the doctor's report, results.json, epochs.csv "
    "and plots into --output-dir. "
    "In a SageMaker training job (any SM_* variable set) the defaults come from the job: the data from its input "
    "channel (SM_CHANNEL_<NAME>: the only one, the one --channel names, else 'training'; never synthetic data), "
    "SM_MODEL_DIR, SM_OUTPUT_DATA_DIR, SM_NUM_GPUS, TensorBoard under /opt/ml/output/tensorboard; and its "
    "hyperparameters (SM_HPS or "
    "hyperparameters.json) set any option below by name (max_epochs or max-epochs: --max-epochs); the command line "
    "wins. With several hosts (SM_HOSTS) each host runs this command under torchrun, the rendezvous on the first host."
)


#: exit status of a run stopped by SIGTERM/SIGUSR1 (128 + SIGTERM), checkpointed where it can be
PREEMPTED_EXIT = STOPPED_EXIT
OUTPUT_FAILED_EXIT = 1  #: exit status of a run whose model was saved but another output could not be written
MODEL_MARGIN = 1.1, 1 << 20  #: the model file's size estimate: its tensors' bytes x 1.1 + 1 MiB (archive, recipe.json)


@dataclass(frozen=True)
class _Outputs:
    """Where a training run writes: the run folder, the model, TensorBoard (``None``: only the run folder's)."""

    output_dir: Path
    model_dir: Path
    tensorboard_dir: Path | None
    checkpoint_dir: Path | None = None
    save_every: int | None = None


def _train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``train`` option to ``parser`` (the sub-command's, or a stand-alone one for hyperparameters)."""
    from monai_fast.recipes import RECIPES

    add_data_options(parser)
    g = parser.add_argument_group("training")
    g.add_argument(
        "--channel",
        help="in a SageMaker job: the input channel to train on (its folder is "
        "SM_CHANNEL_<NAME>; default: the job's only channel, else 'training')",
    )
    g.add_argument("--recipe", choices=RECIPES, default="fast", help="the recipe to train (default %(default)s)")
    g.add_argument(
        "--network",
        choices=NETWORKS,
        default="unet",
        help="MONAI's UNet or SegResNet (init_filters = the first of --channels) (default %(default)s)",
    )
    g.add_argument(
        "--dropout", type=float, default=0.0, help="dropout probability of the network (default %(default)s)"
    )
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the recipe's own (fast: adamw)")
    g.add_argument("--lr", "--learning-rate", type=float, help="learning rate (default: the optimizer's default here)")
    g.add_argument("--max-epochs", "--epochs", type=int, default=100, help="epochs to train (default %(default)s)")
    g.add_argument(
        "--target",
        type=float,
        default=1.0,
        help="stop once validation mean Dice reaches this, in (0, 1] (default %(default)s: run every epoch)",
    )
    g.add_argument("--time-budget", type=float, help="stop after this many seconds (default: no limit)")
    add_validation_options(g)
    add_model_options(parser, race=True)
    g = parser.add_argument_group("output")
    g.add_argument(
        "--output-dir",
        help="run record, report, results and plots (default $SM_OUTPUT_DATA_DIR, else runs/train-<time>)",
    )
    g.add_argument(
        "--model-dir", help="the final model.pth and recipe.json (default $SM_MODEL_DIR, else <output-dir>/model)"
    )
    g.add_argument(
        "--tensorboard-dir",
        help="also write TensorBoard loss and Dice here (default in SageMaker: "
        "$SM_OUTPUT_DIR/tensorboard, where its TensorBoardOutputConfig collects them; else only <output-dir>/<recipe>)",
    )
    g.add_argument(
        "--checkpoint-dir",
        help="make the run preemption-safe: on SIGTERM/SIGUSR1 (a spot reclaim, scancel) "
        "finish the iteration, checkpoint here and exit 143; the same command resumes from here (default in "
        "SageMaker: /opt/ml/checkpoints when the job has checkpointing configured)",
    )
    g.add_argument(
        "--save-every",
        type=int,
        help="with a checkpoint folder, also checkpoint every N iterations, so a crash "
        "loses at most N (default: only on a signal)",
    )
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

    Keys SageMaker adds for its own use (``sagemaker_*``) and ``None`` values are skipped.

    Raises:
        SystemExit: naming the hyperparameter, where it came from, and why it is refused.

    Example:
        >>> hyperparameter_values({"epochs": 2, "network": "segresnet", "patch_size": "32 32 32"}, "SM_HPS")
        {'max_epochs': 2, 'network': 'segresnet', 'patch_size': [32, 32, 32]}
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


def _outputs(args: argparse.Namespace, sm: SageMakerEnv) -> _Outputs:
    output = Path(args.output_dir or sm.output_data_dir or f"runs/train-{dt.datetime.now():%Y%m%d-%H%M%S}")
    model = Path(args.model_dir or sm.model_dir or output / "model")
    tensorboard = args.tensorboard_dir or sm.tensorboard_dir
    checkpoints = args.checkpoint_dir or sm.checkpoint_dir
    if args.save_every is not None and (args.save_every < 1 or not checkpoints):
        raise SystemExit(
            "monai-fast train: --save-every needs a whole number >= 1 and a --checkpoint-dir, got "
            f"{args.save_every} and {checkpoints}"
        )
    return _Outputs(
        output,
        model,
        Path(tensorboard) if tensorboard else None,
        Path(checkpoints) if checkpoints else None,
        args.save_every,
    )


def _attach_tensorboard(built: Any, folder: Path) -> Any:
    """MONAI's TensorBoard handlers on ``built``'s trainer (loss per iteration) and evaluator (Dice per epoch)."""
    from monai.handlers import TensorBoardStatsHandler, from_engine

    from monai_fast.extras import require

    tensorboard = require("torch.utils.tensorboard", extra="plots", feature="train --tensorboard-dir")
    folder.mkdir(parents=True, exist_ok=True)
    writer = tensorboard.SummaryWriter(log_dir=str(folder))
    TensorBoardStatsHandler(
        summary_writer=writer, tag_name="train/loss", output_transform=from_engine(["loss"], first=True)
    ).attach(built.trainer)
    TensorBoardStatsHandler(
        summary_writer=writer,
        iteration_log=False,
        output_transform=lambda out: None,
        global_epoch_transform=lambda _: built.trainer.state.epoch,
    ).attach(built.evaluator)
    return writer


def _model_bytes(config: Any) -> int:
    """Bytes ``model.pth`` needs: the network of ``config`` built on the CPU, its tensors' bytes plus the margin."""
    import torch

    from monai_fast.recipes.common import build_network

    network = build_network(config, torch.device("cpu"))
    tensors = sum(t.numel() * t.element_size() for t in network.state_dict().values())
    return int(tensors * MODEL_MARGIN[0]) + MODEL_MARGIN[1]


def _save_model(built: Any, model_dir: Path) -> Path:
    """``model.pth``: an inference checkpoint (weights + ``RecipeConfig``, ``monai-fast infer`` reads it);
    ``recipe.json`` beside it.

    Both written atomically.
    """
    from monai_fast.files import write_json
    from monai_fast.inference.checkpoint import save_checkpoint

    model_dir.mkdir(parents=True, exist_ok=True)
    path = save_checkpoint(model_dir / "model.pth", built.network, built.config)
    write_json({"recipe": built.name, "config": built.config.to_dict()}, model_dir / "recipe.json")
    return path


def _preemption(built: Any, out: _Outputs) -> Any:
    """:class:`~monai_fast.handlers.Preemption` on ``built``'s trainer (model, optimizer, trainer), resumed from its
    folder."""
    from monai_fast.handlers import Preemption

    preemption = Preemption(
        {"trainer": built.trainer, "model": built.network, "optimizer": built.optimizer},
        out.checkpoint_dir,
        save_every=out.save_every,
    )
    preemption.attach(built.trainer)  # takes over a signal caught during set-up: the run stops at its start
    preemption.resume()  # nothing to resume on a first start
    return preemption


def _stopped_message(preemption: Any, iteration: int, folder: Path | None) -> str:
    """What a stopped run says: the checkpoint written, or why none was needed."""
    name = preemption.stop_signal.name
    if iteration == (preemption.resumed_from or 0):  # signalled before any training in this start
        where = f"the checkpoint at iteration {iteration} in {folder}" if preemption.resumed_from else "the start"
        return (
            f"preempted: {name} before training started, nothing new to checkpoint; the same command starts "
            f"again from {where}"
        )
    return f"preempted: checkpointed at iteration {iteration} in {folder}; the same command resumes from there"


def _write_outputs(
    run: Any, lead: bool, out: _Outputs, plan: Any, data_root: Any, spec: Any
) -> tuple[Any, Path | None, list[str]]:
    """After training: the model first, then epochs.csv, the doctor's report and the results, each on its own.

    A write that fails (a full disk) is named and the others still run, and so is a run record that its full file
    system cut short during training; returns the result, the model's file and the failures' messages.
    """
    from monai_fast.handlers.record import record_of
    from monai_fast.race import run_meta
    from monai_fast.race.compare import write_race
    from monai_fast.report.doctor import doctor

    failed: list[str] = []
    model = None
    record = record_of(run.built.trainer)
    cut = record.record.disk_full if record is not None else None  # the record's file system filled in training
    if lead:
        try:
            model = _save_model(run.built, out.model_dir)
        except OSError as e:
            failed.append(f"model {out.model_dir / 'model.pth'}: {e}")
        if cut is not None:
            failed.append(f"the rest of the {cut}")
    try:
        result = run.finish()
    except OSError as e:  # epochs.csv; the result is kept and finish() returns it
        failed.append(f"epochs.csv: {e}")
        result = run.finish()
    if not lead:
        return result, model, failed
    try:
        result.diagnosis = doctor(result.run_dir).to_dict() if result.run_dir and result.epochs else None
    except OSError as e:
        failed.append(f"the doctor's report in {result.run_dir}: {e}")
    except ValueError as e:  # a record without an epoch to diagnose
        why = f"its record {cut.path} ends before the first epoch, its file system full" if cut is not None else e
        failed.append(f"the doctor's report in {result.run_dir}: {why}")
    try:
        write_race([result], plan.run_dir, run_meta(data_root, plan.device, spec.record_options))
    except OSError as e:
        failed.append(f"results in {plan.run_dir}: {e}")
    return result, model, failed


def _train(local_rank: int, spec: Any, out: _Outputs) -> None:
    """One rank of the run: train ``spec``'s recipe; rank 0 writes the model, the report and the results.

    Rank 0 owns the output folder from the start to the end of the command (its
    :class:`~monai_fast.files.RunFolderLock`, whatever the recipe, and the record's lock in
    ``<output-dir>/<recipe>``, taken again by the record later): a second ``monai-fast train`` into the
    same folder stops at once, before its set-up work, naming the folder and the run that owns it.
    """
    from ignite import distributed as idist

    from monai_fast.files import RunFolderLock
    from monai_fast.race import plan_race
    from monai_fast.telemetry.record import record_lock

    lead = idist.get_rank() == 0
    plan = plan_race(spec, need_run_dir=lead)  # every option checked before any data is read
    owners: list[RunFolderLock] = []
    try:
        if lead and plan.run_dir:  # results.json, epochs.csv and the model's default folder are the folder's own
            owners.append(RunFolderLock(plan.run_dir, what="monai-fast train").acquire())
        if lead:  # every output folder checked, so that no training is lost to an unwritable or full one
            _check_outputs(out, plan)
        if lead and plan.run_dir:  # where TargetRun records: a process that writes the record there stops this run too
            owners.append(record_lock(Path(plan.run_dir) / spec.recipes[0], 0, what="monai-fast train").acquire())
        _train_owned(spec, out, plan, lead)
    finally:
        for owner in reversed(owners):
            owner.release()


def _check_outputs(out: _Outputs, plan: Any) -> None:
    """Every output folder writable, and the model's folder with room for the model, before any work."""
    from monai_fast.files import ensure_free_space
    from monai_fast.race import check_writable_dir

    check_writable_dir(out.model_dir, "model_dir")
    try:
        ensure_free_space(out.model_dir / "model.pth", _model_bytes(plan.config), "model_dir: the model")
    except OSError as e:
        raise SystemExit(f"monai-fast train: {e}; free space there or give another --model-dir") from None
    if out.tensorboard_dir is not None:
        check_writable_dir(out.tensorboard_dir, "tensorboard_dir")
    if out.checkpoint_dir is not None:
        check_writable_dir(out.checkpoint_dir, "checkpoint_dir")


def _train_owned(spec: Any, out: _Outputs, plan: Any, lead: bool) -> None:
    """:func:`_train` once the options and outputs are checked and the run folder is this run's."""
    from monai_fast.race import checked_data
    from monai_fast.race.runner import TargetRun

    data_root, train_files, val_files = checked_data(spec)  # a --data-dir URL is read from object storage
    run = TargetRun(
        spec.recipes[0],
        train_files,
        val_files,
        plan.config,
        plan.device,
        spec.target,
        spec.time_budget_s,
        plan.run_dir if lead else None,
        spec.progress and lead,
    )
    writer = _attach_tensorboard(run.built, out.tensorboard_dir) if lead and out.tensorboard_dir else None
    preemption = _preemption(run.built, out) if out.checkpoint_dir is not None else None
    if preemption is None:
        end_of_setup(PREEMPTED_EXIT)  # a signal caught during set-up, with no checkpoint folder: stop here, saying so
    try:
        run.segment(epochs=None)
    finally:
        if writer is not None:
            writer.close()
    if preemption is not None and preemption.preempted:
        if lead:
            print(_stopped_message(preemption, run.built.trainer.state.iteration, out.checkpoint_dir), flush=True)
        preemption.exit_if_preempted(PREEMPTED_EXIT)
    result, model, failed = _write_outputs(run, lead, out, plan, data_root, spec)
    for line in failed:
        print(f"monai-fast train: not written: {line}", file=sys.stderr, flush=True)
    if not lead:
        return
    dice = "none" if result.best_dice is None else f"{result.best_dice:.3f}"
    print(
        f"trained {result.recipe} ({plan.config.network}) for {result.epochs_run} epochs in {result.total_s:.1f} s "
        f"on {result.device}: best validation Dice {dice}",
        flush=True,
    )
    if result.diagnosis:
        report = Path(result.run_dir or "") / "report.md"
        print(
            f"doctor: {result.diagnosis['verdict']}: {result.diagnosis['evidence'][0]}  "
            f"(report: {report if report.is_file() else 'not written'})"
        )
    results = Path(plan.run_dir) / "results.json"
    print(f"model: {model or 'not written'}\nresults: {results if results.is_file() else 'not written'}")
    if out.tensorboard_dir:
        print(f"tensorboard --logdir {out.tensorboard_dir}")
    if failed:
        raise SystemExit(OUTPUT_FAILED_EXIT)


def _cmd_train(args: argparse.Namespace) -> int:
    """The command: stop signals caught from its first line (until a ``Preemption`` or the end of set-up)."""
    with stop_signals_caught(PREEMPTED_EXIT):  # a signal while the job is read, the data checked or cached: kept
        return _train_command(args)


def _train_command(args: argparse.Namespace) -> int:
    from monai_fast.distributed import detect, run
    from monai_fast.race.options import resolve_device
    from monai_fast.race.scale import demo_scale

    try:
        sm = read_sagemaker_env()
    except SageMakerEnvError as e:
        raise SystemExit(f"monai-fast train: SageMaker environment: {e}") from e
    if sm.present:
        logger.info("SageMaker job: %s", sm.describe())
    args = _merged(args, sm)
    if len(sm.hosts) > 1 and detect().launcher == "none":
        end_of_setup(PREEMPTED_EXIT)  # the launcher passes signals on to the ranks from here
        return _launch_hosts(sm)
    import torch

    out = _outputs(args, sm)
    args.recipes = [args.recipe]
    spec = race_spec(args, str(out.output_dir), demo_scale(torch.device(resolve_device(args.device))))
    chosen = {k: getattr(args, k) for k in ("network", "dropout", "optimizer", "lr") if getattr(args, k) is not None}
    spec = replace(spec, overrides={**spec.overrides, **chosen})
    run(_train, spec, out, seed=args.seed)
    return 0


def _launch_hosts(sm: SageMakerEnv) -> int:
    """This host's share of a multi-host job: this same command line under torchrun, rendezvous on the first host."""
    import os

    from monai_fast.distributed.env import LAUNCHED_BY
    from monai_fast.distributed.supervise import supervise

    cmd = torchrun_command(sm, ["-m", "monai_fast.cli", *sys.argv[1:]])
    print("launching: " + " ".join(cmd), flush=True)
    return supervise(cmd, grace_s=120.0, env={**os.environ, LAUNCHED_BY: str(len(sm.hosts))})


def add_train_command(sub: argparse._SubParsersAction) -> None:
    """Add ``train`` to the sub-command parsers ``sub``."""
    p = sub.add_parser(
        "train",
        description=_TEXT,
        help="train one recipe and save the model; SageMaker's channels, model dir and hyperparameters when present",
    )
    _train_parser(p)
    p.set_defaults(func=_cmd_train, tune=False)
