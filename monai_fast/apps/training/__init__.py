"""Train one recipe toward a target with its telemetry: the product behind ``monai-fast train``.

`TrainJob` / `train_job()` train one recipe from its options into a run folder; `TargetRun` /
`run_to_target()` below them train toward a target Dice.
"""

from monai_fast.apps.training.data import (
    NUM_CLASSES,
    DataSource,
    DemoScale,
    SyntheticData,
    check_files,
    checked_files,
    demo_scale,
    load_files,
)
from monai_fast.apps.training.job import TrainJob, TrainOutcome, train_job
from monai_fast.apps.training.options import OptionError, check_writable_dir, recipe_config, resolve_device
from monai_fast.apps.training.results import plot_dice_vs_time, run_meta, write_results
from monai_fast.apps.training.run import (
    EpochRecorder,
    EpochRow,
    TargetRun,
    TrainResult,
    run_to_target,
    write_epochs_csv,
)

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
