"""Bundle-aware tuning: measure a bundle's batch sizes on this device and write an override file.

:func:`tune_bundle` reads a bundle's config with MONAI's ``ConfigParser`` (the same merge and
overrides as ``monai.bundle``), takes the pieces it trains with (the network, the loss, the
optimizer's class and settings, the training patch and crops per volume, the sliding window's ROI
and overlap, one validation volume through the validation chain for its size), runs the tuner
(:class:`~monai_fast.tune.Tuner`: training batch size, sliding-window batch size, where the
validation volume and the stitched output live) and writes ``tuned.json``: the config ids it sets
and their values, which the bundle reads as one more config file::

    monai-fast tune --bundle spleen_ct_segmentation dataset_dir=/data/Task09_Spleen
    python -m monai.bundle run --config_file "['configs/train.json','configs/tuned.json']"

The keys follow the config's own layout: the Model Zoo's ``train#dataloader#batch_size``,
``validate#inferer#sw_batch_size`` and ``validate#inferer#device``; an Auto3DSeg-generated
algorithm's ``num_images_per_batch``, ``num_sw_batch_size`` and ``validation_data_device``.

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

from monai_fast.bundle.run import BundleError, bundle_config_files
from monai_fast.files import write_json

__all__ = ["AUTO3DSEG_KEYS", "ZOO_KEYS", "BundleTuning", "tune_bundle"]

logger = logging.getLogger("monai_fast.bundle")

#: what the tuner sets, in the Model Zoo's config layout
ZOO_KEYS = {
    "batch": "train#dataloader#batch_size",
    "sw_batch": "validate#inferer#sw_batch_size",
    "val_device": "validate#inferer#device",
}
#: and in an Auto3DSeg-generated algorithm's (``hyper_parameters.yaml``)
AUTO3DSEG_KEYS = {
    "batch": "num_images_per_batch",
    "sw_batch": "num_sw_batch_size",
    "val_device": "validation_data_device",
}


@dataclass
class BundleTuning:
    """What :func:`tune_bundle` measured and wrote.

    Attributes:
        overrides: config id -> value, as written to the override file.
        path: the override file.
        result: the tuner's full result (every trial) as a dict.
        layout: ``"zoo"`` or ``"auto3dseg"``: which keys were used.
    """

    overrides: dict[str, Any]
    path: Path
    result: dict = field(default_factory=dict)
    layout: str = "zoo"


def _parser(bundle_dir: Path, config_files: str | Sequence[str] | None, overrides: Mapping[str, Any]):
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([str(f) for f in bundle_config_files(bundle_dir, config_files)])
    meta = bundle_dir / "configs" / "metadata.json"
    if meta.is_file():
        parser.read_meta(str(meta))
    pairs = {"bundle_root": str(bundle_dir), **dict(overrides)}
    parser.update(pairs)
    parser.parse(reset=True)
    return parser


def _first(parser: Any, ids: Sequence[str], what: str) -> tuple[str, Any]:
    for cid in ids:
        if cid in parser:
            return cid, parser.get_parsed_content(cid)
    raise BundleError(f"the config has none of {', '.join(ids)} ({what})")


def _find_in(transforms: Any, attr_names: Sequence[str]) -> dict[str, Any]:
    """Attributes of the first transform in a ``Compose`` (or list) that has any of ``attr_names``."""
    items = getattr(transforms, "transforms", transforms)
    for t in items if isinstance(items, (list, tuple)) else []:
        for obj in (t, getattr(t, "cropper", None)):
            found = {a: getattr(obj, a) for a in attr_names if obj is not None and getattr(obj, a, None) is not None}
            if found:
                return found
    return {}


def tune_bundle(
    bundle_dir: str | os.PathLike,
    config_files: str | Sequence[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    out: str | os.PathLike | None = None,
    batch_range: tuple[int, int] = (1, 16),
    sw_batch_range: tuple[int, int] = (1, 32),
    precision: str | None = None,
    progress: bool = False,
    **timing: float,
) -> BundleTuning:
    """Measure a bundle's batch sizes on its device and write the override file.

    Args:
        bundle_dir: the bundle folder.
        config_files: as for :func:`~monai_fast.bundle.run_bundle`.
        overrides: config overrides (data lists, device, ...), as for ``run_bundle``.
        out: the override file; default ``<bundle_dir>/configs/tuned.json``.
        batch_range: training batch sizes to search (volumes per batch).
        sw_batch_range: sliding-window batch sizes to search.
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``; default: the config's ``amp`` on CUDA means
            fp16, else fp32 (FastTraining decides reduced precision on a CPU at run time).
        progress: a progress bar over the trials.
        **timing: ``warmup``, ``min_iters``, ``min_time_s`` per trial, passed to the tuner.

    Returns:
        What was measured and written (:class:`BundleTuning`).

    Raises:
        BundleError: a piece the tuner needs is not in the config (named), or the bundle is not a
            3-D segmentation the tuner can time.
    """
    from monai_fast.tune import SearchSpace, Tuner

    root = Path(bundle_dir).resolve()
    parser = _parser(root, config_files, overrides or {})
    auto3dseg = "num_images_per_batch" in parser
    keys = AUTO3DSEG_KEYS if auto3dseg else ZOO_KEYS
    _, network = _first(parser, ["network_def", "network"], "the network")
    _, loss = _first(parser, ["loss", "train#loss", "loss_function"], "the training loss")
    _, optimizer = _first(parser, ["optimizer", "train#optimizer"], "the optimizer")
    device = parser.get_parsed_content("device") if "device" in parser else torch.device("cpu")
    device = torch.device(device)
    inferer_id, inferer = _first(parser, ["validate#inferer", "infer#inferer"], "the validation inferer")
    roi = getattr(inferer, "roi_size", None)
    if roi is None or len(tuple(roi)) != 3:
        raise BundleError(
            f"{inferer_id} is not a 3-D sliding window (roi_size {roi}): the bundle tuner times "
            "3-D segmentation bundles"
        )
    roi = tuple(int(r) for r in roi)
    crop = (
        _find_in(parser.get_parsed_content("train#preprocessing"), ("spatial_size", "num_samples"))
        if "train#preprocessing" in parser
        else {}
    )
    patch = tuple(int(s) for s in crop.get("spatial_size", roi))
    if len(patch) != 3 or min(patch) < 1:
        patch = roi
    num_samples = int(crop.get("num_samples", 1) or 1)
    val_shape = _val_shape(parser) or roi
    in_channels = int(getattr(network, "in_channels", 0) or _config_int(parser, "network_def#in_channels", 1))
    out_channels = int(getattr(network, "out_channels", 0) or _config_int(parser, "network_def#out_channels", 2))
    if precision is None:
        amp = bool(parser.get("train#trainer#amp", False)) if "train#trainer#amp" in parser else False
        precision = "fp16" if amp and device.type == "cuda" else "fp32"
    opt_class, opt_defaults = type(optimizer), dict(optimizer.defaults)
    tuner = Tuner(
        copy.deepcopy(network).to(device),
        loss,
        lambda params: opt_class(params, **opt_defaults),
        patch_size=patch,
        val_shape=val_shape,
        device=device,
        num_samples=num_samples,
        in_channels=in_channels,
        out_channels=out_channels,
        overlap=float(getattr(inferer, "overlap", 0.25)),
        space=SearchSpace(batch_range=batch_range, sw_batch_range=sw_batch_range, precisions=[precision]),
        **timing,
    )
    result = tuner.run(progress=progress)
    tuned: dict[str, Any] = {keys["batch"]: int(result.batch_size), keys["sw_batch"]: int(result.sw_batch_size)}
    if torch.device(result.val_device) != device:
        tuned[keys["val_device"]] = result.val_device if auto3dseg else f"$torch.device('{result.val_device}')"
    path = Path(out) if out is not None else root / "configs" / "tuned.json"
    write_json(tuned, path)
    logger.info(
        "bundle tuning: %s -> %s (patch %s x %d crops, validation volume %s, %s on %s)",
        tuned,
        path,
        "x".join(map(str, patch)),
        num_samples,
        "x".join(map(str, val_shape)),
        precision,
        device,
    )
    return BundleTuning(overrides=tuned, path=path, result=result.to_dict(), layout="auto3dseg" if auto3dseg else "zoo")


def _config_int(parser: Any, cid: str, default: int) -> int:
    try:
        return int(parser[cid]) if cid in parser else default
    except (TypeError, ValueError):
        return default


def _val_shape(parser: Any) -> tuple[int, ...] | None:
    """The spatial size of the first validation volume after the validation chain (no cache built)."""
    if "validate#preprocessing" not in parser or "validate#dataset#data" not in parser:
        return None
    data = parser.get_parsed_content("validate#dataset#data")
    if not data:
        return None
    item = parser.get_parsed_content("validate#preprocessing")(dict(data[0]))
    image = item.get("image") if isinstance(item, dict) else None
    shape = tuple(int(s) for s in getattr(image, "shape", ())[1:])
    return shape if len(shape) == 3 else None
