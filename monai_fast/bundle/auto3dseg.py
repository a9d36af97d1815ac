"""An algorithm folder that Auto3DSeg generated, read for the bundle tuner (the keys set: docs/bundles.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from monai_fast.bundle.checks import TRAIN_CONFIG_NAMES, BundleError, require_yaml_reader
from monai_fast.bundle.pieces import TunerPieces, first_entry, optimizer_factory, parsed, size3
from monai_fast.telemetry.cuda import cuda_available

__all__ = [
    "AUTO3DSEG_KEYS",
    "auto3dseg_config_files",
    "auto3dseg_pieces",
    "is_auto3dseg_algorithm",
    "reads_as_auto3dseg",
]

#: what the tuner sets in an Auto3DSeg algorithm's ``hyper_parameters.yaml`` (under ``training``, else at the top)
AUTO3DSEG_KEYS = {"batch": "num_images_per_batch", "sw_batch": "num_sw_batch_size", "val_device": "sw_input_on_cpu"}
_HYPER_PARAMETERS = "hyper_parameters.yaml"


def auto3dseg_config_files(bundle_dir: str | os.PathLike, skip: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Every ``.yaml``/``.json`` file of ``<bundle_dir>/configs`` in name order, as Auto3DSeg passes them to its
    training script, less the files in ``skip`` (the override file being rewritten).

    Raises:
        BundleError: the folder has no ``configs/hyper_parameters.yaml``.
        MissingExtraError: pyyaml, which reads the YAML files, is not installed (the ``bundle`` extra).

    Examples:
        >>> [f.name for f in auto3dseg_config_files("work_dir/swinunetr_0")]  # doctest: +SKIP
        ['hyper_parameters.yaml', 'network.yaml', 'transforms_infer.yaml', 'transforms_train.yaml', ...]
    """
    configs = Path(bundle_dir) / "configs"
    if not (configs / _HYPER_PARAMETERS).is_file():
        raise BundleError(f"{configs} has no {_HYPER_PARAMETERS}: not an Auto3DSeg-generated algorithm")
    left_out = {Path(s).resolve() for s in skip}
    files = [
        f
        for f in sorted(configs.iterdir())
        if f.is_file() and f.suffix in (".yaml", ".yml", ".json") and f.resolve() not in left_out
    ]
    require_yaml_reader(files)
    return files


def is_auto3dseg_algorithm(root: Path) -> bool:
    """Whether ``root`` is an Auto3DSeg algorithm folder: ``configs/hyper_parameters.yaml`` and no train config."""
    configs = root / "configs"
    return (configs / _HYPER_PARAMETERS).is_file() and not any((configs / n).is_file() for n in TRAIN_CONFIG_NAMES)


def reads_as_auto3dseg(parser: Any) -> bool:
    """Whether a parsed config carries Auto3DSeg's ``num_images_per_batch`` (in ``training`` or at the top)."""
    return any(cid in parser for cid in ("training#num_images_per_batch", "num_images_per_batch"))


def auto3dseg_pieces(parser: Any) -> TunerPieces:
    """An Auto3DSeg algorithm's pieces: its hyper-parameters (``training#...`` or at the top) and ``network``."""
    p = "training#" if "training#num_images_per_batch" in parser else ""

    def value(name: str, *more: str, default: Any = None) -> tuple[str, Any]:
        for cid in (p + name, *more):
            if cid in parser and parser.get_parsed_content(cid) is not None:
                return cid, parser.get_parsed_content(cid)
        return p + name, default

    channels: dict[str, Any] = {}
    for name in ("input_channels", "output_classes"):
        cid, channels[name] = value(name, name)
        if channels[name] is None:
            raise BundleError(
                f"{cid} is not set: Auto3DSeg fills it from the data analysis when it generates the algorithm "
                f"(give it as {cid}=N)"
            )
    _, network = first_entry(
        parser, ["network", p + "network", "training_network#network", "network_def"], "the network"
    )
    _, loss = first_entry(parser, [p + "loss", "loss"], "the training loss")
    # as the algorithms' scripts do: a network with deep supervision (SegResNetDS) trains on every output
    from monai.losses import DeepSupervisionLoss

    loss = DeepSupervisionLoss(loss)
    optimizer = optimizer_factory(parser, [p + "optimizer", "optimizer"])
    patch_id, patch = value("roi_size", p + "patch_size", "roi_size")
    patch = size3(patch, patch_id)
    roi_id, roi = value("roi_size_valid", p + "patch_size_valid", "roi_size_valid", default=patch)
    roi = size3(roi, roi_id)
    _, overlap = value("overlap_ratio", default=0.625)
    _, samples = value("num_patches_per_image", "num_crops_per_image", default=1)
    _, amp = value("amp", "amp", default=False)
    keys = {k: p + name for k, name in AUTO3DSEG_KEYS.items() if k == "batch" or p + name in parser}
    train_items, train_items_from = _train_items(parser)
    return TunerPieces(
        network=network,
        loss=loss,
        optimizer=optimizer,
        device=torch.device("cuda" if cuda_available() else "cpu"),
        patch=patch,
        roi=roi,
        overlap=float(overlap),
        num_samples=int(samples or 1),
        val_shape=_val_shape(parser, p) or roi,
        in_channels=int(channels["input_channels"]),
        out_channels=int(channels["output_classes"]),
        amp=bool(amp),
        keys=keys,
        layout="auto3dseg",
        train_items=train_items,
        train_items_from=train_items_from,
    )


def _fold_split(parser: Any) -> tuple[list[dict], list[dict], str] | None:
    """The fold's training and validation items and the data list's path, split as the algorithms' scripts do;
    ``None`` without a data list file."""
    listed = parsed(parser, "data_list_file_path")
    if not listed or not Path(str(listed)).is_file():
        return None
    entries = json.loads(Path(str(listed)).read_text())
    items = entries.get("training", [])
    if entries.get("validation"):
        return items, entries["validation"], str(listed)
    fold = parsed(parser, "fold") or 0
    return [e for e in items if e.get("fold") != fold], [e for e in items if e.get("fold") == fold], str(listed)


def _train_items(parser: Any) -> tuple[int | None, str]:
    """Volumes the algorithm trains on in its fold, and the data list counted (or why unknown)."""
    split = _fold_split(parser)
    if split is None:
        return None, "data_list_file_path is not a file"
    return len(split[0]), f"{split[2]}, fold {parsed(parser, 'fold', 0)}"


def _val_shape(parser: Any, prefix: str) -> tuple[int, ...] | None:
    """The spatial size of the fold's first validation image after resampling, from its NIfTI header alone."""
    import nibabel as nib

    split = _fold_split(parser)
    if split is None or not split[1]:
        return None
    _, val, listed = split
    base = parsed(parser, "data_file_base_dir")
    image = val[0]["image"]
    image = image[0] if isinstance(image, (list, tuple)) else image
    path = Path(str(base or "")) / image
    try:
        header = nib.load(str(path)).header
    except (OSError, nib.filebasedimages.ImageFileError) as err:
        raise BundleError(f"validation image {path} (from {listed}) cannot be read: {err}") from err
    shape = tuple(int(s) for s in header.get_data_shape()[:3])
    # the target spacing (``resample_to_spacing`` in older templates); a ``resample`` switch turns it off
    ids = (prefix + "resample_resolution", prefix + "resample_to_spacing", "resample_resolution")
    resamples = "resample" not in parser or parsed(parser, "resample")
    spacing = next((parsed(parser, c) for c in ids if parsed(parser, c)), None) if resamples else None
    if spacing:
        zooms = header.get_zooms()[:3]
        shape = tuple(max(1, round(s * z / float(t))) for s, z, t in zip(shape, zooms, spacing))
    return shape if len(shape) == 3 else None
