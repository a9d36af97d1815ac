"""A recipe's epochs as rows, for the harness: `monai_fast.apps.training.epochs`'s objects."""

from monai_fast.apps.training.epochs import EPOCH_FIELDS, EpochRecorder, EpochRow, write_epochs_csv

__all__ = ["EPOCH_FIELDS", "EpochRecorder", "EpochRow", "write_epochs_csv"]
