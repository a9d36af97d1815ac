"""One recipe trained from its options (`TrainJob`) into a run folder: model, record, report, results."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from monai_fast.apps.training.data import VAL_FRACTION, DataSource, SyntheticData
from monai_fast.apps.training.options import (
    OptionError,
    check_precision,
    check_run_numbers,
    check_synthetic,
    check_writable_dir,
    recipe_config,
    resolve_device,
)

if TYPE_CHECKING:
    from monai_fast.apps.recipes import Recipe, RecipeConfig
    from monai_fast.apps.training.run import TargetRun, TrainResult
    from monai_fast.handlers import Preemption

__all__ = ["MODEL_MARGIN", "OWNER", "TrainJob", "TrainOutcome", "model_bytes", "train_job"]

MODEL_MARGIN = 1.1, 1 << 20  #: the model file's size estimate: its tensors' bytes x 1.1 + 1 MiB (archive, recipe.json)
OWNER = "monai-fast train"  #: who holds the output folder, in the message a second run into it stops with


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    """What to train, on what, until when, and where its outputs go; every option checked here.

    Attributes:
        recipe: a recipe of `RECIPES`.
        output_dir: the run folder: record, report, ``results.json``, ``epochs.csv`` and plots.
        model_dir: ``model.pth`` and ``recipe.json``; ``None``: ``<output_dir>/model``.
        data_dir: an MSD-layout folder or its URL; ``None``: ``synthetic`` data.
        synthetic, val_fraction, seed: the synthetic set, the validation share, the seed of everything.
        preflight, overrides: check every file of the data before training; `RecipeConfig` fields.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        target, time_budget_s: validation mean Dice to stop at (1: every epoch runs); seconds of training.
        progress, tensorboard_dir: progress bars (on rank 0); also write TensorBoard events here.
        checkpoint_dir, save_every: make the run preemption-safe (`Preemption`), checkpointing every N iterations.
        record_options: what ``results.json`` records under ``options``.

    Raises:
        OptionError: naming the first bad option, before anything runs.

    Example:
        >>> TrainJob(output_dir="runs/x", device="cpu").model_dir
        PosixPath('runs/x/model')
    """

    recipe: str = "fast"
    output_dir: str | os.PathLike
    model_dir: str | os.PathLike | None = None
    data_dir: str | os.PathLike | None = None
    synthetic: SyntheticData = field(default_factory=SyntheticData)
    val_fraction: float = VAL_FRACTION
    seed: int = 0
    preflight: bool = True
    overrides: Mapping[str, Any] = field(default_factory=dict)
    device: str = "auto"
    target: float = 1.0
    time_budget_s: float | None = None
    progress: bool = True
    tensorboard_dir: str | os.PathLike | None = None
    checkpoint_dir: str | os.PathLike | None = None
    save_every: int | None = None
    record_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        from monai_fast.apps.recipes import RECIPES

        for name in ("output_dir", "model_dir", "tensorboard_dir", "checkpoint_dir"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if self.model_dir is None:
            object.__setattr__(self, "model_dir", Path(self.output_dir) / "model")
        if self.recipe not in RECIPES:
            raise OptionError("recipe", f"unknown recipe {self.recipe!r}; known: {list(RECIPES)}")
        check_run_numbers(self.target, self.time_budget_s, self.val_fraction)
        if self.save_every is not None and (self.save_every < 1 or self.checkpoint_dir is None):
            raise OptionError(
                "save_every",
                f"needs a whole number >= 1 and a checkpoint folder, got {self.save_every} and {self.checkpoint_dir}",
            )
        if self.data_dir is None:
            check_synthetic(self.synthetic.kind, self.synthetic.cases, self.synthetic.shape)
        check_precision(self.config, resolve_device(self.device))

    @property
    def config(self) -> RecipeConfig:
        """The recipe options: ``overrides`` with ``seed``."""
        return recipe_config(self.overrides, self.seed)

    @property
    def source(self) -> DataSource:
        """Where the cases come from."""
        return DataSource(self.data_dir, self.synthetic, self.val_fraction, self.seed)


@dataclass(frozen=True)
class TrainOutcome:
    """What `train_job()` did on one rank.

    Attributes:
        lead, network: this rank wrote the outputs (rank 0); the network trained (``"unet"``, ``"segresnet"``).
        result: the run's `TrainResult`; ``None`` when a stop signal stopped it.
        model, results, report: ``model.pth``, ``results.json``, the doctor's ``report.md`` where written.
        failed: the outputs that could not be written, each with why (a full disk: the space missing).
        stopped: what a run stopped by a stop signal says (the checkpoint written, or why none was needed).
    """

    lead: bool
    network: str
    result: TrainResult | None = None
    model: Path | None = None
    results: Path | None = None
    report: Path | None = None
    failed: tuple[str, ...] = ()
    stopped: str | None = None


def train_job(job: TrainJob) -> TrainOutcome:
    """Train ``job`` on this rank; rank 0 holds the output folder (`RunFolderLock`) and writes the outputs.

    Every output folder is checked before any data is read; the model is written first, then each other
    output on its own. A stop signal during set-up stops the program as training starts (exit status 143)
    unless ``job.checkpoint_dir`` is set; then it checkpoints and ``stopped`` says where.

    Raises:
        OptionError: an output folder that cannot be written or that holds another run's record (unless this run
            resumes from its checkpoint), or a model folder without room for the model.
        monai_fast.folders.RunFolderBusyError: another run holds the output folder.

    Example:
        >>> outcome = train_job(TrainJob(output_dir="runs/mine", device="cpu"))  # doctest: +SKIP
    """
    from ignite import distributed as idist

    from monai_fast.files import ensure_free_space
    from monai_fast.folders import RunFolderLock
    from monai_fast.handlers.checkpoint_folder import checkpoints_in
    from monai_fast.telemetry.run_record import record_lock

    lead = idist.get_rank() == 0
    config = job.config
    output_dir = Path(job.output_dir)
    with contextlib.ExitStack() as owners:
        if lead:  # results.json, epochs.csv and the model's default folder are the folder's own
            # every output folder writable, the run folder last (a refused one leaves it empty)
            for option in ("model_dir", "tensorboard_dir", "checkpoint_dir", "output_dir"):
                if getattr(job, option) is not None:
                    check_writable_dir(getattr(job, option), option)
            try:
                ensure_free_space(Path(job.model_dir or "") / "model.pth", model_bytes(config), "the model")
            except OSError as e:
                raise OptionError("model_dir", f"{e}; free space there or give another") from None
            owners.enter_context(RunFolderLock(output_dir, what=OWNER))
            # where TargetRun records: a process that writes the record there stops this run too
            owners.enter_context(record_lock(output_dir / job.recipe, 0, what=OWNER))
            held = sorted((output_dir / job.recipe).glob("record.rank*.jsonl"))
            resumes = job.checkpoint_dir is not None and bool(checkpoints_in(job.checkpoint_dir))
            if held and not resumes:  # a record goes on only in the run that wrote it, resumed from its checkpoint
                raise OptionError(
                    "output_dir",
                    f"{output_dir} holds another run's record ({held[0]}): give a new folder, or that run's "
                    "--checkpoint-dir to resume it",
                )
        return _train_owned(job, config, lead)


def _train_owned(job: TrainJob, config: RecipeConfig, lead: bool) -> TrainOutcome:
    """`train_job()` once the options and outputs are checked and the run folder is this run's."""
    from monai_fast.apps.training.data import checked_files
    from monai_fast.apps.training.run import TargetRun
    from monai_fast.handlers.preemption import STOPPED_EXIT, end_of_setup

    device = resolve_device(job.device)
    data_root, train_files, val_files = checked_files(job.source, config, job.preflight, job.progress)
    out = job.output_dir if lead else None
    run = TargetRun(
        job.recipe, train_files, val_files, config, device, job.target, job.time_budget_s, out, job.progress and lead
    )
    writer = _attach_tensorboard(run.built, Path(job.tensorboard_dir)) if lead and job.tensorboard_dir else None
    preemption = None
    if job.checkpoint_dir is not None:
        from monai_fast.handlers import Preemption

        built = run.built
        state = {"trainer": built.trainer, "model": built.network, "optimizer": built.optimizer}
        state.update(clock=run.stopper, epochs=run.recorder)  # results.json and epochs.csv cover the whole run
        preemption = Preemption(state, job.checkpoint_dir, save_every=job.save_every)
        preemption.attach(built.trainer)  # takes over a signal caught during set-up: the run stops at its start
        preemption.resume()  # nothing to resume on a first start
    else:
        end_of_setup(STOPPED_EXIT)  # a signal caught during set-up, with no checkpoint folder: stop here, saying so
    try:
        run.segment(epochs=None)
    finally:
        if writer is not None:
            writer.close()
    if preemption is not None and preemption.preempted:
        stopped = _stopped_message(preemption, run.built.trainer.state.iteration, job.checkpoint_dir)
        return TrainOutcome(lead, config.network, stopped=stopped)
    return _write_outputs(run, lead, job, device, data_root)


def _attach_tensorboard(built: Recipe, folder: Path) -> Any:
    """MONAI's TensorBoard handlers on ``built``'s trainer (loss per iteration) and evaluator (Dice per epoch)."""
    from monai.handlers import TensorBoardStatsHandler

    from monai_fast.apps.training.run import loss_writer

    writer = loss_writer(folder, built.trainer, "train --tensorboard-dir")
    TensorBoardStatsHandler(
        summary_writer=writer,
        iteration_log=False,
        output_transform=lambda out: None,
        global_epoch_transform=lambda _: built.trainer.state.epoch,
    ).attach(built.evaluator)
    return writer


def model_bytes(config: RecipeConfig) -> int:
    """Bytes ``model.pth`` needs: the network of ``config`` built on the CPU, its tensors' bytes plus the margin."""
    import torch

    from monai_fast.apps.recipes.parts import build_network

    network = build_network(config, torch.device("cpu"))
    tensors = sum(t.numel() * t.element_size() for t in network.state_dict().values())
    return int(tensors * MODEL_MARGIN[0]) + MODEL_MARGIN[1]


def _stopped_message(preemption: Preemption, iteration: int, folder: str | os.PathLike | None) -> str:
    """What a stopped run says: the checkpoint written, or why none was needed."""
    name = preemption.stop_signal.name
    if iteration == (preemption.resumed_from or 0):  # signalled before any training in this start
        where = f"the checkpoint at iteration {iteration} in {folder}" if preemption.resumed_from else "the start"
        return (
            f"preempted: {name} before training started, nothing new to checkpoint; the same command starts "
            f"again from {where}"
        )
    return f"preempted: checkpointed at iteration {iteration} in {folder}; the same command resumes from there"


def _write_outputs(run: TargetRun, lead: bool, job: TrainJob, device: str, data_root: Any) -> TrainOutcome:
    """The model, then epochs.csv, the doctor's report and the results: a write that fails is named, the rest run."""
    from monai_fast.apps.inference.checkpoint import save_checkpoint
    from monai_fast.apps.training.results import run_meta, write_results
    from monai_fast.files import write_json
    from monai_fast.handlers.record import record_of
    from monai_fast.report.doctor import doctor

    failed: list[str] = []
    model = None
    model_dir = Path(job.model_dir or "")
    record = record_of(run.built.trainer)
    cut = record.record.disk_full if record is not None else None  # the record's file system filled in training
    if lead:  # model.pth (weights and RecipeConfig, for monai-fast infer) and recipe.json, each atomically
        try:
            model_dir.mkdir(parents=True, exist_ok=True)
            model = save_checkpoint(model_dir / "model.pth", run.built.network, run.built.config)
            write_json({"recipe": run.built.name, "config": run.built.config.to_dict()}, model_dir / "recipe.json")
        except OSError as e:
            failed.append(f"model {model_dir / 'model.pth'}: {e}")
        if cut is not None:
            failed.append(f"the rest of the {cut}")
    try:
        result: TrainResult = run.finish()
    except OSError as e:  # epochs.csv; the result is kept and finish() returns it
        failed.append(f"epochs.csv: {e}")
        result = run.finish()
    network = run.built.config.network
    if not lead:
        return TrainOutcome(lead, network, result, failed=tuple(failed))
    try:
        result.diagnosis = doctor(result.run_dir).to_dict() if result.run_dir and result.epochs else None
    except OSError as e:
        failed.append(f"the doctor's report in {result.run_dir}: {e}")
    except ValueError as e:  # a record without an epoch to diagnose
        why = f"its record {cut.path} ends before the first epoch, its file system full" if cut is not None else e
        failed.append(f"the doctor's report in {result.run_dir}: {why}")
    results: Path | None = Path(job.output_dir) / "results.json"
    try:
        write_results([result], job.output_dir, run_meta(data_root, device, job.record_options))
    except OSError as e:  # an earlier run's results.json in the folder is not this run's
        failed.append(f"results in {job.output_dir}: {e}")
        results = None
    report = Path(result.run_dir or "") / "report.md"
    return TrainOutcome(
        lead, network, result, model, results, report if result.diagnosis and report.is_file() else None, tuple(failed)
    )
