"""One recipe trained to a target, for the harness: `monai_fast.apps.training.run`'s objects under the harness's
names (its result is a `RaceResult`)."""

from monai_fast.apps.training.run import EPOCH_FIELDS, EpochRow, TargetRun, TrainResult, run_to_target, write_epochs_csv

RaceResult = TrainResult  #: a recipe's outcome in a race

__all__ = ["EPOCH_FIELDS", "EpochRow", "RaceResult", "TargetRun", "run_to_target", "write_epochs_csv"]
