"""A run's data: an MSD-layout folder or URL, given file lists, or cached synthetic data; every file checked first.

Also how big a run on synthetic data is by default on a device (``demo`` and ``train``), with no CUDA call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from monai_fast.apps.recipes import RecipeConfig

__all__ = [
    "NUM_CLASSES",
    "VAL_FRACTION",
    "DataSource",
    "DemoScale",
    "SyntheticData",
    "check_files",
    "checked_files",
    "demo_scale",
    "load_files",
]

logger = logging.getLogger(__name__)

#: classes of the recipes' task (background and one organ); label values must be 0 or 1
NUM_CLASSES = 2

#: share of a data set's cases held out for validation by default
VAL_FRACTION = 0.25


@dataclass(frozen=True)
class SyntheticData:
    """The synthetic set generated (once, then reused from the cache folder) when no data is given."""

    kind: str = "spleen-like"
    cases: int = 16
    shape: tuple[int, int, int] = (128, 128, 64)


@dataclass(frozen=True)
class DemoScale:
    """The default data and network of a run on a device (the demo's and train's).

    Attributes:
        device, name: the device type it is for (``"cuda"``, ``"cpu"``); what the default is, in words.
        synthetic: the synthetic set generated when no data is given.
        overrides: `RecipeConfig` fields (patch, network) set for every recipe.
    """

    device: str
    synthetic: SyntheticData
    overrides: dict[str, Any] = field(default_factory=dict)
    name: str = "small"


def demo_scale(device: torch.device) -> DemoScale:
    """The default size on ``device``: spleen-scale with MONAI's tutorial UNet on CUDA, small elsewhere (docs/demo.md).

    Example:
        >>> import torch
        >>> demo_scale(torch.device("cpu")).overrides
        {}
    """
    if device.type == "cuda":
        return DemoScale(
            "cuda",
            SyntheticData(cases=40, shape=(240, 240, 96)),  # 1.6 x 1.6 x 2.5 mm: ~256 x 256 x 120 at 1.5 x 1.5 x 2
            dict(patch_size=(96, 96, 96), channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2), num_res_units=2),
            "spleen-scale (like Task09 Spleen after resampling), MONAI's tutorial UNet",
        )
    return DemoScale(device.type, SyntheticData(), {}, "small, for a CPU")


@dataclass(frozen=True)
class DataSource:
    """Where a run's cases come from.

    Attributes:
        data_dir: an MSD-layout folder with ``dataset.json``, or its URL.
        synthetic: the synthetic set generated when neither ``data_dir`` nor the file lists are given.
        val_fraction: share of ``data_dir``'s cases held out for validation.
        seed: seed of the synthetic data and of the split.
        train_files, val_files: ``{"image", "label"}`` dicts, used as they are when both are given.
    """

    data_dir: str | os.PathLike | None = None
    synthetic: SyntheticData = field(default_factory=SyntheticData)
    val_fraction: float = VAL_FRACTION
    seed: int = 0
    train_files: Sequence[dict] | None = None
    val_files: Sequence[dict] | None = None


def load_files(source: DataSource, progress: bool = True) -> tuple[Path | str | None, list[dict], list[dict]]:
    """``(data_root, train_files, val_files)`` of ``source``: its file lists, its ``data_dir`` or its synthetic data.

    ``progress`` draws a progress bar while synthetic data is written.

    Raises:
        FileNotFoundError, monai_fast.apps.sources.msd.MSDDataError: ``data_dir`` is missing or incomplete.
    """
    from monai_fast.apps.sources.msd import load_msd_datalist
    from monai_fast.apps.sources.remote import is_url
    from monai_fast.apps.sources.synthetic import synthetic_dataset

    if source.train_files is not None and source.val_files is not None:
        return None, list(source.train_files), list(source.val_files)
    if source.data_dir is not None:  # a folder, or a URL (s3://bucket/Task09_Spleen) kept as written
        root = str(source.data_dir) if is_url(str(source.data_dir)) else Path(source.data_dir)
    else:
        syn = source.synthetic
        root = synthetic_dataset(syn.kind, syn.cases, syn.shape, source.seed, progress)
    train_files, val_files = load_msd_datalist(root, val_fraction=source.val_fraction, seed=source.seed)
    return root, train_files, val_files


def check_files(
    train_files: Sequence[dict], val_files: Sequence[dict], config: RecipeConfig, preflight: bool = True
) -> None:
    """Every file checked (`preflight()`) before any training unless ``preflight`` is off; a patch larger than the
    volumes of ``config`` logged.

    Raises:
        monai_fast.data.preflight.PreflightError: listing every bad file with its reason.
    """
    from monai_fast.data.preflight import patch_padding
    from monai_fast.data.preflight import preflight as check

    if preflight:
        check([*train_files, *val_files], num_classes=NUM_CLASSES)
    warning = patch_padding(list(train_files), config.patch_size, config.pixdim)
    if warning:
        logger.warning(warning)


def checked_files(
    source: DataSource, config: RecipeConfig, preflight: bool = True, progress: bool = True
) -> tuple[Path | str | None, list[dict], list[dict]]:
    """`load_files()` of ``source``, then `check_files()` (arguments and errors as theirs)."""
    data_root, train_files, val_files = load_files(source, progress)
    check_files(train_files, val_files, config, preflight)
    return data_root, train_files, val_files
