"""The validation chain of a network as a plain-data record (never code) a checkpoint carries and inference rebuilds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import monai.transforms
from monai.transforms import Compose, MapTransform

from monai_fast.apps.recipes.config import RecipeConfig
from monai_fast.apps.recipes.transforms import KEYS

__all__ = ["ALLOWED", "ChainError", "build_chain", "check_chain", "recipe_chain"]

#: the MONAI dictionary transforms a chain record may name: deterministic preprocessing, invertible where it
#: changes the grid, so that ``Invertd`` takes a prediction back onto the input's grid
ALLOWED = frozenset(
    {
        "LoadImaged",
        "EnsureChannelFirstd",
        "Orientationd",
        "Spacingd",
        "ScaleIntensityRanged",
        "ScaleIntensityd",
        "NormalizeIntensityd",
        "ClipIntensityPercentilesd",
        "CropForegroundd",
        "SpatialPadd",
        "DivisiblePadd",
        "CenterSpatialCropd",
        "ResizeWithPadOrCropd",
        "Resized",
    }
)
_PLAIN = (str, int, float, bool, type(None))


class ChainError(ValueError):
    """A chain record that cannot be rebuilt; the message names the entry and what is wrong with it."""


def recipe_chain(config: RecipeConfig) -> list[dict[str, Any]]:
    """The recipes' validation chain for ``config`` as a record: the same transforms as `deterministic_transforms()`."""
    keys = list(KEYS)
    return [
        {"_target_": "LoadImaged", "keys": keys},
        {"_target_": "EnsureChannelFirstd", "keys": keys},
        {"_target_": "Orientationd", "keys": keys, "axcodes": "RAS", "labels": [["L", "R"], ["P", "A"], ["I", "S"]]},
        {"_target_": "Spacingd", "keys": keys, "pixdim": list(config.pixdim), "mode": ["bilinear", "nearest"]},
        {
            "_target_": "ScaleIntensityRanged",
            "keys": "image",
            "a_min": config.intensity_window[0],
            "a_max": config.intensity_window[1],
            "b_min": 0.0,
            "b_max": 1.0,
            "clip": True,
        },
        {"_target_": "CropForegroundd", "keys": keys, "source_key": "image", "allow_smaller": True},
        {"_target_": "SpatialPadd", "keys": keys, "spatial_size": list(config.patch_size)},
    ]


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def check_chain(record: Any) -> list[dict[str, Any]]:
    """``record`` as a list of transform entries, each naming an `ALLOWED` transform with plain arguments.

    Raises:
        ChainError: naming the first entry at fault.
    """
    if not isinstance(record, (list, tuple)) or not record:
        raise ChainError(f"the chain record is not a list of transforms (got {type(record).__name__})")
    entries = []
    for i, entry in enumerate(record):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("_target_"), str):
            raise ChainError(f"chain entry {i} is not a mapping with a '_target_' transform name: {entry!r:.120}")
        name = entry["_target_"]
        if name not in ALLOWED:
            raise ChainError(
                f"chain entry {i} names {name!r}, which is not one of the deterministic MONAI transforms "
                f"inference rebuilds ({', '.join(sorted(ALLOWED))})"
            )
        bad = [k for k, v in entry.items() if not isinstance(k, str) or not _plain(v)]
        if bad:
            raise ChainError(f"chain entry {i} ({name}): argument(s) {bad} are not plain values (text, numbers, lists)")
        entries.append(dict(entry))
    return entries


def build_chain(record: Sequence[Mapping[str, Any]], image_key: str = "image") -> Compose:
    """The transforms of ``record``, each with ``allow_missing_keys=True`` (the label is missing at inference).

    Raises:
        ChainError: a record entry that is not allowed, not plain, or not accepted by its transform;
            or a record whose transforms never touch ``image_key``.
    """
    entries = check_chain(record)
    transforms: list[MapTransform] = []
    for i, entry in enumerate(entries):
        name = entry.pop("_target_")
        args = {k: _tuple(v) for k, v in entry.items()}
        try:
            transforms.append(getattr(monai.transforms, name)(**args, allow_missing_keys=True))
        except (TypeError, ValueError) as e:
            raise ChainError(f"chain entry {i} ({name}) cannot be built from its arguments {entry}: {e}") from e
    if not any(image_key in t.keys for t in transforms):
        raise ChainError(
            f"no transform of the chain record acts on {image_key!r} (keys: "
            f"{sorted({k for t in transforms for k in t.keys})})"
        )
    return Compose(transforms)


def _tuple(value: Any) -> Any:
    """A record's lists as tuples (MONAI takes both; tuples are what the recipes pass)."""
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value
