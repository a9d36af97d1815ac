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
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from monai_fast.bundle.run import _CONFIG_NAMES, BundleError, bundle_config_files
from monai_fast.files import write_json
from monai_fast.telemetry.cuda import cuda_available

__all__ = ["AUTO3DSEG_KEYS", "ZOO_KEYS", "BundleTuning", "auto3dseg_config_files", "tune_bundle"]

logger = logging.getLogger("monai_fast.bundle")

#: what the tuner sets, in the Model Zoo's config layout
ZOO_KEYS = {
    "batch": "train#dataloader#batch_size",
    "sw_batch": "validate#inferer#sw_batch_size",
    "val_device": "validate#inferer#device",
}
#: and in an Auto3DSeg-generated algorithm's ``hyper_parameters.yaml`` (the names below its ``training``
#: section; the templates without that section keep them at the top)
AUTO3DSEG_KEYS = {
    "batch": "num_images_per_batch",
    "sw_batch": "num_sw_batch_size",
    "val_device": "sw_input_on_cpu",
}
_AUTO3DSEG_HYPER = "hyper_parameters.yaml"


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


def auto3dseg_config_files(bundle_dir: str | os.PathLike, skip: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """The config files of an Auto3DSeg-generated algorithm, as Auto3DSeg passes them to its training script.

    Every ``.yaml``/``.json`` file of ``<bundle_dir>/configs`` in name order (MONAI's ``BundleAlgo``
    builds the training command the same way), less the files in ``skip`` (the override file being
    rewritten, so an earlier tuning is not read as the algorithm's own setting).

    Raises:
        BundleError: the folder has no ``configs/hyper_parameters.yaml``.
    """
    configs = Path(bundle_dir) / "configs"
    if not (configs / _AUTO3DSEG_HYPER).is_file():
        raise BundleError(f"{configs} has no {_AUTO3DSEG_HYPER}: not an Auto3DSeg-generated algorithm")
    left_out = {Path(s).resolve() for s in skip}
    return [
        f
        for f in sorted(configs.iterdir())
        if f.is_file() and f.suffix in (".yaml", ".yml", ".json") and f.resolve() not in left_out
    ]


def _is_auto3dseg(root: Path) -> bool:
    configs = root / "configs"
    return (configs / _AUTO3DSEG_HYPER).is_file() and not any((configs / n).is_file() for n in _CONFIG_NAMES)


def _parser(bundle_dir: Path, files: Sequence[Path], overrides: Mapping[str, Any]):
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([str(f) for f in files])
    meta = bundle_dir / "configs" / "metadata.json"
    if meta.is_file() and meta not in files:
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


def _optimizer_factory(parser: Any, ids: Sequence[str]) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> optimizer`` built from the config's optimizer entry with the given parameters.

    The entry is resolved but not instantiated, then instantiated with ``params`` for each trial: a
    Model Zoo entry's own ``params`` (the bundle's network) is replaced, and an Auto3DSeg entry, which
    names no ``params`` (its script adds them), gets them.
    """
    from monai.bundle import ConfigComponent

    for cid in ids:
        if cid in parser:
            entry = parser.get_parsed_content(cid, instantiate=False)
            if not isinstance(entry, ConfigComponent):
                raise BundleError(f"{cid} is not a component with a _target_ (the optimizer)")
            return lambda params: entry.instantiate(params=params)
    raise BundleError(f"the config has none of {', '.join(ids)} (the optimizer)")


def _find_in(transforms: Any, attr_names: Sequence[str]) -> dict[str, Any]:
    """Attributes of the first transform in a ``Compose`` (or list) that has any of ``attr_names``."""
    items = getattr(transforms, "transforms", transforms)
    for t in items if isinstance(items, (list, tuple)) else []:
        for obj in (t, getattr(t, "cropper", None)):
            found = {a: getattr(obj, a) for a in attr_names if obj is not None and getattr(obj, a, None) is not None}
            if found:
                return found
    return {}


@dataclass
class _Pieces:
    """What the tuner needs from a bundle, whichever its layout."""

    network: torch.nn.Module
    loss: Any
    optimizer: Callable[[Any], torch.optim.Optimizer]
    device: torch.device
    patch: tuple[int, ...]
    roi: tuple[int, ...]
    overlap: float
    num_samples: int
    val_shape: tuple[int, ...]
    in_channels: int
    out_channels: int
    amp: bool
    keys: dict[str, str]
    layout: str


def _size3(value: Any, cid: str) -> tuple[int, ...]:
    try:
        size = tuple(int(s) for s in value)
    except (TypeError, ValueError):
        size = ()
    if len(size) != 3 or min(size) < 1:
        raise BundleError(
            f"{cid} is {value!r}, not a 3-D size: the bundle tuner times 3-D segmentation bundles (set it, "
            f"e.g. {cid}=[96,96,96])"
        )
    return size


def _zoo_pieces(parser: Any) -> _Pieces:
    _, network = _first(parser, ["network_def", "network"], "the network")
    _, loss = _first(parser, ["loss", "train#loss", "loss_function"], "the training loss")
    optimizer = _optimizer_factory(parser, ["optimizer", "train#optimizer"])
    device = torch.device(parser.get_parsed_content("device") if "device" in parser else "cpu")
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
    return _Pieces(
        network=network,
        loss=loss,
        optimizer=optimizer,
        device=device,
        patch=patch,
        roi=roi,
        overlap=float(getattr(inferer, "overlap", 0.25)),
        num_samples=int(crop.get("num_samples", 1) or 1),
        val_shape=_val_shape(parser) or roi,
        in_channels=int(getattr(network, "in_channels", 0) or _config_int(parser, "network_def#in_channels", 1)),
        out_channels=int(getattr(network, "out_channels", 0) or _config_int(parser, "network_def#out_channels", 2)),
        amp=bool(parser.get("train#trainer#amp", False)) if "train#trainer#amp" in parser else False,
        keys=dict(ZOO_KEYS),
        layout="zoo",
    )


def _auto3dseg_pieces(parser: Any) -> _Pieces:
    """An Auto3DSeg algorithm's pieces: its hyper-parameters (``training#...`` or at the top) and ``network``."""
    p = "training#" if "training#num_images_per_batch" in parser else ""

    def value(name: str, *more: str, default: Any = None) -> tuple[str, Any]:
        for cid in (p + name, *more):
            if cid in parser and parser.get_parsed_content(cid) is not None:
                return cid, parser.get_parsed_content(cid)
        return p + name, default

    for name in ("input_channels", "output_classes"):
        cid, v = value(name, name)
        if v is None:
            raise BundleError(
                f"{cid} is not set: Auto3DSeg fills it from the data analysis when it generates the algorithm "
                f"(give it as {cid}=N)"
            )
    _, network = _first(parser, ["network", p + "network", "training_network#network", "network_def"], "the network")
    _, loss = _first(parser, [p + "loss", "loss"], "the training loss")
    # the algorithms' scripts wrap the loss so that a network with deep supervision (segresnet's
    # SegResNetDS returns one output per depth when training) is trained on every output
    from monai.losses import DeepSupervisionLoss

    loss = DeepSupervisionLoss(loss)
    optimizer = _optimizer_factory(parser, [p + "optimizer", "optimizer"])
    patch_id, patch = value("roi_size", p + "patch_size", "roi_size")
    patch = _size3(patch, patch_id)
    roi_id, roi = value("roi_size_valid", p + "patch_size_valid", "roi_size_valid", default=patch)
    roi = _size3(roi, roi_id)
    _, overlap = value("overlap_ratio", default=0.625)
    _, samples = value("num_patches_per_image", "num_crops_per_image", default=1)
    _, amp = value("amp", "amp", default=False)
    keys = {k: p + name for k, name in AUTO3DSEG_KEYS.items() if k == "batch" or p + name in parser}
    return _Pieces(
        network=network,
        loss=loss,
        optimizer=optimizer,
        device=torch.device("cuda" if cuda_available() else "cpu"),
        patch=patch,
        roi=roi,
        overlap=float(overlap),
        num_samples=int(samples or 1),
        val_shape=_auto3dseg_val_shape(parser, p) or roi,
        in_channels=int(value("input_channels", "input_channels")[1]),
        out_channels=int(value("output_classes", "output_classes")[1]),
        amp=bool(amp),
        keys=keys,
        layout="auto3dseg",
    )


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
        bundle_dir: the bundle folder: a Model Zoo bundle, or an algorithm folder Auto3DSeg generated.
        config_files: as for :func:`~monai_fast.bundle.run_bundle`; default ``configs/train.json|yaml``,
            or for an Auto3DSeg algorithm every config file of ``configs/`` as Auto3DSeg reads them
            (:func:`auto3dseg_config_files`).
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
    if not root.is_dir():
        raise BundleError(f"bundle folder {root} does not exist")
    path = Path(out) if out is not None else root / "configs" / "tuned.json"
    if config_files is None and _is_auto3dseg(root):
        files = auto3dseg_config_files(root, skip=[path])
    else:
        files = bundle_config_files(root, config_files)
    parser = _parser(root, files, overrides or {})
    auto3dseg = any(cid in parser for cid in ("training#num_images_per_batch", "num_images_per_batch"))
    pieces = _auto3dseg_pieces(parser) if auto3dseg else _zoo_pieces(parser)
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


def _auto3dseg_val_shape(parser: Any, prefix: str) -> tuple[int, ...] | None:
    """The spatial size of the algorithm's first validation image after resampling, from its header alone.

    Reads the fold's first validation entry of the data list (``data_list_file_path``,
    ``data_file_base_dir``, ``fold``; Auto3DSeg's ``fold`` key in each ``training`` item, or a
    ``validation`` list), its NIfTI header through nibabel (no voxels read), and scales the shape by
    the header's spacing over the algorithm's target spacing where it resamples.
    """
    import nibabel as nib

    def get(cid: str) -> Any:
        return parser.get_parsed_content(cid) if cid in parser else None

    listed, base = get("data_list_file_path"), get("data_file_base_dir")
    if not listed or not Path(str(listed)).is_file():
        return None
    entries = json.loads(Path(str(listed)).read_text())
    fold = get("fold") or 0
    val = entries.get("validation") or [e for e in entries.get("training", []) if e.get("fold") == fold]
    if not val:
        return None
    image = val[0]["image"]
    image = image[0] if isinstance(image, (list, tuple)) else image
    path = Path(str(base or "")) / image
    try:
        header = nib.load(str(path)).header
    except (OSError, nib.filebasedimages.ImageFileError) as err:
        raise BundleError(f"validation image {path} (from {listed}) cannot be read: {err}") from err
    shape = tuple(int(s) for s in header.get_data_shape()[:3])
    # the templates name the target spacing ``resample_resolution`` (``resample_to_spacing`` in older ones);
    # those with a ``resample`` switch resample only where it is on
    spacing = None
    if "resample" not in parser or get("resample"):
        spacing = next(
            (
                get(c)
                for c in (prefix + "resample_resolution", prefix + "resample_to_spacing", "resample_resolution")
                if get(c)
            ),
            None,
        )
    if spacing:
        zooms = header.get_zooms()[:3]
        shape = tuple(max(1, round(s * z / float(t))) for s, z, t in zip(shape, zooms, spacing))
    return shape if len(shape) == 3 else None
