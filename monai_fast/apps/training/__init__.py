"""Train one recipe toward a target with its telemetry: the product behind ``monai-fast train``.

`TrainJob` and `train_job()` (``job.py``) train one recipe from its options into a run folder
(model, record, report, results); below them, `TargetRun` and `run_to_target()` (``run.py``) train
a recipe toward a target Dice with monai-fast's telemetry, its epochs as rows (``epochs.py``), on data loaded
and checked by ``data.py``, sized per device by ``scale.py``, with results files from ``results.py``. The race
harness (`monai_fast.apps.demo`) builds on these; nothing here imports it.

Examples:
    >>> from monai_fast.apps.training import TrainJob, train_job
    >>> job = TrainJob(output_dir="runs/mine", device="cpu", overrides={"max_epochs": 2})
    >>> outcome = train_job(job)  # doctest: +SKIP
    >>> outcome.result.epochs_run  # doctest: +SKIP
    2
"""

from monai_fast.apps.training.data import NUM_CLASSES, DataSource, SyntheticData, check_files, checked_files, load_files
from monai_fast.apps.training.epochs import EpochRecorder, EpochRow, write_epochs_csv
from monai_fast.apps.training.job import TrainJob, TrainOutcome, train_job
from monai_fast.apps.training.options import OptionError, check_writable_dir, recipe_config, resolve_device
from monai_fast.apps.training.results import plot_dice_vs_time, run_meta, write_results
from monai_fast.apps.training.run import TargetRun, TrainResult, run_to_target
from monai_fast.apps.training.scale import DemoScale, demo_scale

__all__ = [
    "NUM_CLASSES",
    "DataSource",
    "DemoScale",
    "EpochRecorder",
    "EpochRow",
    "OptionError",
    "SyntheticData",
    "TargetRun",
    "TrainJob",
    "TrainOutcome",
    "TrainResult",
    "check_files",
    "check_writable_dir",
    "checked_files",
    "demo_scale",
    "load_files",
    "plot_dice_vs_time",
    "recipe_config",
    "resolve_device",
    "run_meta",
    "run_to_target",
    "train_job",
    "write_epochs_csv",
    "write_results",
]
