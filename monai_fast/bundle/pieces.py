"""What the bundle tuner takes from a bundle's config (`TunerPieces`), and how it reads a Model Zoo bundle."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from monai_fast.bundle.checks import BundleError

__all__ = [
    "ZOO_KEYS",
    "TunerPieces",
    "first_entry",
    "optimizer_factory",
    "parsed",
    "read_config",
    "size3",
    "zoo_pieces",
]

#: what the tuner sets, in the Model Zoo's config layout
ZOO_KEYS = {
    "batch": "train#dataloader#batch_size",
    "sw_batch": "validate#inferer#sw_batch_size",
    "val_device": "validate#inferer#device",
}


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
