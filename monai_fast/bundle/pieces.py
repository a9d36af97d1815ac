"""What the bundle tuner takes from a bundle's config (`TunerPieces`), and how it reads a Model Zoo bundle or an
algorithm folder that Auto3DSeg generated (the keys set: docs/bundles.md)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from monai_fast.bundle.checks import TRAIN_CONFIG_NAMES, BundleError, require_yaml_reader
from monai_fast.telemetry.cuda import cuda_available

__all__ = [
    "AUTO3DSEG_KEYS",
    "ZOO_KEYS",
    "TunerPieces",
    "auto3dseg_config_files",
    "auto3dseg_pieces",
    "first_entry",
    "is_auto3dseg_algorithm",
    "optimizer_factory",
    "parsed",
    "read_config",
    "reads_as_auto3dseg",
    "size3",
    "zoo_pieces",
]

#: what the tuner sets, in the Model Zoo's config layout
ZOO_KEYS = {
    "batch": "train#dataloader#batch_size",
    "sw_batch": "validate#inferer#sw_batch_size",
    "val_device": "validate#inferer#device",
}
#: what the tuner sets in an Auto3DSeg algorithm's ``hyper_parameters.yaml`` (under ``training``, else at the top)
AUTO3DSEG_KEYS = {"batch": "num_images_per_batch", "sw_batch": "num_sw_batch_size", "val_device": "sw_input_on_cpu"}
_HYPER_PARAMETERS = "hyper_parameters.yaml"


def read_config(bundle_dir: Path, files: Sequence[Path], overrides: Mapping[str, Any]):
    """MONAI's ``ConfigParser`` over ``files`` (merged in order), the bundle's metadata and ``overrides``, parsed."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([str(f) for f in files])
    meta = bundle_dir / "configs" / "metadata.json"
    if meta.is_file() and meta not in files:
        parser.read_meta(str(meta))
    parser.update({"bundle_root": str(bundle_dir), **dict(overrides)})
    parser.parse(reset=True)
    return parser


def parsed(parser: Any, cid: str, default: Any = None) -> Any:
    """The parsed (instantiated) content of ``cid``, or ``default`` where the config has no such id."""
    return parser.get_parsed_content(cid) if cid in parser else default


def first_entry(parser: Any, ids: Sequence[str], what: str, instantiate: bool = True) -> tuple[str, Any]:
    """The first of ``ids`` the config has, and its parsed content (a ``ConfigComponent`` unless ``instantiate``);
    a `BundleError` naming them all and ``what`` they are for when it has none."""
    for cid in ids:
        if cid in parser:
            return cid, parser.get_parsed_content(cid, instantiate=instantiate)
    raise BundleError(f"the config has none of {', '.join(ids)} ({what})")


def optimizer_factory(parser: Any, ids: Sequence[str]) -> Callable[[Any], torch.optim.Optimizer]:
    """``params -> optimizer`` built from the config's optimizer entry, its own ``params`` (if any) replaced."""
    from monai.bundle import ConfigComponent

    cid, entry = first_entry(parser, ids, "the optimizer", instantiate=False)
    if not isinstance(entry, ConfigComponent):
        raise BundleError(f"{cid} is not a component with a _target_ (the optimizer)")
    return lambda params: entry.instantiate(params=params)


def size3(value: Any, cid: str) -> tuple[int, ...]:
    """``value`` as a 3-D size; a `BundleError` naming ``cid`` when it is not one."""
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


@dataclass
class TunerPieces:
    """What the tuner needs from a bundle, whichever its layout.

    Attributes:
        network: the bundle's network (copied to the device before timing).
        optimizer: ``params -> optimizer``, the bundle's optimizer with its settings.
        patch: the training crop (D, H, W).
        roi: the sliding window's ROI (D, H, W).
        val_shape: the spatial size of one validation volume.
        keys: which config id takes each tuned value (``batch``, ``sw_batch``, ``val_device``).
        layout: ``"zoo"`` or ``"auto3dseg"``.
        train_items: volumes in the training set, ``None`` when unknown without building the dataset.
        train_items_from: where ``train_items`` was counted (a config id or a data list), or why it is unknown.
    """

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
    train_items: int | None = None
    train_items_from: str = ""
    drop_last: bool = False


def zoo_pieces(parser: Any) -> TunerPieces:
    """A Model Zoo bundle's pieces: ``network_def``, ``loss``, ``optimizer``, the crop, ``validate#inferer``."""
    _, network = first_entry(parser, ["network_def", "network"], "the network")
    _, loss = first_entry(parser, ["loss", "train#loss", "loss_function"], "the training loss")
    optimizer = optimizer_factory(parser, ["optimizer", "train#optimizer"])
    device = torch.device(parsed(parser, "device", "cpu"))
    inferer_id, inferer = first_entry(parser, ["validate#inferer", "infer#inferer"], "the validation inferer")
    roi = getattr(inferer, "roi_size", None)
    if roi is None or len(tuple(roi)) != 3:
        raise BundleError(
            f"{inferer_id} is not a 3-D sliding window (roi_size {roi}): the bundle tuner times "
            "3-D segmentation bundles"
        )
    roi = tuple(int(r) for r in roi)
    crop = _find_in(parsed(parser, "train#preprocessing"), ("spatial_size", "num_samples"))
    patch = tuple(int(s) for s in crop.get("spatial_size", roi))
    if len(patch) != 3 or min(patch) < 1:
        patch = roi
    train_items, train_items_from = _train_items(parser)
    return TunerPieces(
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
        amp=bool(parser.get("train#trainer#amp", False)),
        keys=dict(ZOO_KEYS),
        layout="zoo",
        train_items=train_items,
        train_items_from=train_items_from,
        drop_last=bool(parsed(parser, "train#dataloader#drop_last", False)),
    )


def _train_items(parser: Any) -> tuple[int | None, str]:
    """How many volumes the training loader's ``data`` list holds, and the config id counted (or why not)."""
    dataset = "train#dataset"
    named = parser.get("train#dataloader#dataset")
    if isinstance(named, str) and named.startswith("@"):
        dataset = named[1:].replace("::", "#")  # MONAI keeps references with its "::" separator
    cid = f"{dataset}#data"
    if cid not in parser:
        return None, f"the config has no {cid}"
    data = parser.get_parsed_content(cid)
    try:
        return len(data), cid
    except TypeError:
        return None, f"{cid} is {type(data).__name__}, not a list"


def _find_in(transforms: Any, attr_names: Sequence[str]) -> dict[str, Any]:
    """Attributes of the first transform in a ``Compose`` (or list) that has any of ``attr_names``."""
    items = getattr(transforms, "transforms", transforms)
    for t in items if isinstance(items, (list, tuple)) else []:
        for obj in (t, getattr(t, "cropper", None)):
            found = {a: getattr(obj, a) for a in attr_names if obj is not None and getattr(obj, a, None) is not None}
            if found:
                return found
    return {}


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
    train_items, train_items_from = _fold_train_items(parser)
    return TunerPieces(
        network=network,
        loss=loss,
        optimizer=optimizer,
        device=torch.device("cuda" if cuda_available() else "cpu"),
        patch=patch,
        roi=roi,
        overlap=float(overlap),
        num_samples=int(samples or 1),
        val_shape=_fold_val_shape(parser, p) or roi,
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


def _fold_train_items(parser: Any) -> tuple[int | None, str]:
    """Volumes the algorithm trains on in its fold, and the data list counted (or why unknown)."""
    split = _fold_split(parser)
    if split is None:
        return None, "data_list_file_path is not a file"
    return len(split[0]), f"{split[2]}, fold {parsed(parser, 'fold', 0)}"


def _fold_val_shape(parser: Any, prefix: str) -> tuple[int, ...] | None:
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
