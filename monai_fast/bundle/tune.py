"""Bundle-aware tuning: measure a bundle's batch sizes on this device and write an override file.

:func:`tune_bundle` reads a bundle's config with MONAI's ``ConfigParser`` (the same merge and
overrides as ``monai.bundle``), takes the pieces it trains with (the network, the loss, the
optimizer's class and settings, the training patch and crops per volume, the sliding window's ROI
and overlap, the size of one validation volume), runs the tuner (:class:`~monai_fast.tune.Tuner`:
training batch size, sliding-window batch size, where the validation volume and the stitched output
live) and writes ``tuned.json``: the config ids it sets and their values, which the bundle reads as
one more config file::

    monai-fast tune --bundle spleen_ct_segmentation --set dataset_dir=/data/Task09_Spleen
    python -m monai.bundle run --config_file "['configs/train.json','configs/tuned.json']"

Two layouts are read:

- the Model Zoo's (``configs/train.json|yaml``): the keys set are
  ``train#dataloader#batch_size``, ``validate#inferer#sw_batch_size`` and ``validate#inferer#device``;
- an algorithm that Auto3DSeg generated (``configs/hyper_parameters.yaml`` and its neighbours, no
  train config): its hyper-parameters ``num_images_per_batch``, ``num_sw_batch_size`` and
  ``sw_input_on_cpu`` (in its ``training`` section where it has one), the keys Auto3DSeg's own GPU
  customisation fills. Auto3DSeg passes every ``.yaml``/``.json`` file of ``configs/`` to the
  algorithm's training script in name order, so ``configs/tuned.json`` is read after the files it
  overrides with no change to the command.

Example:
    >>> from monai_fast.bundle.tune import tune_bundle
    >>> tuned = tune_bundle(
    ...     "spleen_ct_segmentation", overrides={"dataset_dir": "/data/Task09_Spleen"}
    ... )  # doctest: +SKIP
    >>> tuned.overrides  # doctest: +SKIP
    {'train#dataloader#batch_size': 4, 'validate#inferer#sw_batch_size': 8}
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from monai_fast.bundle.auto3dseg import (
    AUTO3DSEG_KEYS,
    auto3dseg_config_files,
    auto3dseg_pieces,
    is_auto3dseg_algorithm,
    reads_as_auto3dseg,
)
from monai_fast.bundle.pieces import ZOO_KEYS, read_config, zoo_pieces
from monai_fast.bundle.run import BundleError, bundle_config_files, check_config_files, check_overrides
from monai_fast.files import write_json

__all__ = ["BundleTuning", "tune_bundle"]

logger = logging.getLogger("monai_fast.bundle")


@dataclass
class BundleTuning:
    """What :func:`tune_bundle` measured and wrote.

    Attributes:
        overrides: config id -> value, as written to the override file.
        path: the override file.
        result: the tuner's full result (every trial) as a dict.
        layout: ``"zoo"`` or ``"auto3dseg"``: which keys were used.
        config_files: the config files read, in merge order.
    """

    overrides: dict[str, Any]
    path: Path
    result: dict = field(default_factory=dict)
    layout: str = "zoo"
    config_files: list[Path] = field(default_factory=list)


def tune_bundle(
    bundle_dir: str | os.PathLike,
    config_files: str | Sequence[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    out: str | os.PathLike | None = None,
    batch_range: tuple[int, int] = (1, 16),
    sw_batch_range: tuple[int, int] = (1, 32),
    precision: str | None = None,
    progress: bool = False,
    new_keys: Sequence[str] = (),
    **timing: float,
) -> BundleTuning:
    """Measure a bundle's batch sizes on its device and write the override file.

    Args:
        bundle_dir: the bundle folder: a Model Zoo bundle, or an algorithm folder Auto3DSeg generated.
        config_files: as for :func:`~monai_fast.bundle.run_bundle`; default ``configs/train.json|yaml``,
            or for an Auto3DSeg algorithm every config file of ``configs/`` as Auto3DSeg reads them
            (:func:`~monai_fast.bundle.auto3dseg.auto3dseg_config_files`).
        overrides: config overrides (data lists, device, ...), as for ``run_bundle``.
        out: the override file; default ``<bundle_dir>/configs/tuned.json``.
        batch_range: training batch sizes to search (volumes per batch).
        sw_batch_range: sliding-window batch sizes to search.
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``; default: the config's ``amp`` on CUDA means
            fp16, else fp32 (FastTraining decides reduced precision on a CPU at run time).
        progress: a progress bar over the trials.
        new_keys: override ids a Model Zoo config does not have that the user adds on purpose; any other id
            it lacks is refused (:func:`~monai_fast.bundle.run.check_overrides`), as a misspelt one would be
            ignored and the tuner would measure the bundle as it is.
        **timing: ``warmup``, ``min_iters``, ``min_time_s`` per trial, passed to the tuner.

    Returns:
        What was measured and written (:class:`BundleTuning`).

    Raises:
        BundleError: a piece the tuner needs is not in the config (named), or the bundle is not a
            3-D segmentation the tuner can time.
    """
    from monai_fast.tune import SearchSpace, Tuner

    root = Path(bundle_dir).resolve()
    if not root.is_dir():
        raise BundleError(f"bundle folder {root} does not exist")
    path = Path(out) if out is not None else root / "configs" / "tuned.json"
    if config_files is None and is_auto3dseg_algorithm(root):
        files = auto3dseg_config_files(root, skip=[path])
    else:
        files = bundle_config_files(root, config_files)
    check_config_files(files)
    parser = read_config(root, files, overrides or {})
    auto3dseg = reads_as_auto3dseg(parser)
    if not auto3dseg:  # an Auto3DSeg algorithm's runner takes keys its templates lack (data_list_file_path, ...)
        check_overrides(files, list(overrides or {}), new_keys, exempt=("bundle_root",))
    pieces = auto3dseg_pieces(parser) if auto3dseg else zoo_pieces(parser)
    if precision is None:
        precision = "fp16" if pieces.amp and pieces.device.type == "cuda" else "fp32"
    tuner = Tuner(
        copy.deepcopy(pieces.network).to(pieces.device),
        pieces.loss,
        pieces.optimizer,
        patch_size=pieces.patch,
        val_shape=pieces.val_shape,
        device=pieces.device,
        num_samples=pieces.num_samples,
        in_channels=pieces.in_channels,
        out_channels=pieces.out_channels,
        overlap=pieces.overlap,
        space=SearchSpace(batch_range=batch_range, sw_batch_range=sw_batch_range, precisions=[precision]),
        **timing,
    )
    result = tuner.run(progress=progress)
    keys = pieces.keys
    tuned: dict[str, Any] = {keys["batch"]: int(result.batch_size)}
    if "sw_batch" in keys:
        tuned[keys["sw_batch"]] = int(result.sw_batch_size)
    if torch.device(result.val_device) != pieces.device and "val_device" in keys:
        # the Model Zoo names the device; Auto3DSeg says whether the volume stays on the CPU
        tuned[keys["val_device"]] = (
            torch.device(result.val_device).type == "cpu" if auto3dseg else f"$torch.device('{result.val_device}')"
        )
    every = AUTO3DSEG_KEYS if auto3dseg else ZOO_KEYS
    not_set = [every[k] for k in every if k not in keys]
    write_json(tuned, path)
    logger.info(
        "bundle tuning: %s -> %s (patch %s x %d crops, validation volume %s, %s on %s)%s",
        tuned,
        path,
        "x".join(map(str, pieces.patch)),
        pieces.num_samples,
        "x".join(map(str, pieces.val_shape)),
        precision,
        pieces.device,
        f"; the config has no key for {', '.join(not_set)}" if not_set else "",
    )
    return BundleTuning(
        overrides=tuned, path=path, result=result.to_dict(), layout=pieces.layout, config_files=list(files)
    )
