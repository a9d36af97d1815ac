"""Reader for data sets in the Medical Segmentation Decathlon (MSD) layout, every listed file checked first.

Unlike ``monai.data.load_decathlon_datalist`` alone, a missing file or an image whose shape differs
from its label's is one error naming the path; MONAI then lists the pairs and ``partition_dataset`` splits them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
from monai.data import load_decathlon_datalist, partition_dataset

from monai_fast.apps.sources.remote import is_url, localize
from monai_fast.data.preflight import shape_mismatch

__all__ = ["MSDDataError", "case_id", "load_msd_datalist", "read_dataset_json"]

logger = logging.getLogger("monai_fast.apps.sources.msd")


class MSDDataError(ValueError):
    """A data set in MSD layout is incomplete or inconsistent; the message names the path."""


def case_id(path: str | os.PathLike) -> str:
    """The case name of an MSD file: ``.../spleen_12.nii.gz`` -> ``spleen_12``."""
    name = Path(path).name
    for ext in (".nii.gz", ".nii", ".nrrd", ".mha"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def read_dataset_json(root: str | os.PathLike, remote_options: Mapping[str, Any] | None = None) -> dict:
    """Read and minimally validate ``root/dataset.json``; a URL's is fetched into the local cache like the data.

    ``remote_options`` are keyword arguments for `localize()` when ``root`` is a URL. A missing folder or file
    is a ``FileNotFoundError``; not JSON, or no ``training`` list of ``{"image", "label"}``, an `MSDDataError`.
    """
    if is_url(str(root)):
        meta, _, offline = _remote_meta(str(root), dict(remote_options or {}))
        if offline:
            logger.warning(offline)
        return meta
    root = Path(root)
    path = root / "dataset.json"
    if not root.is_dir():
        raise FileNotFoundError(f"MSD data folder {root} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: an MSD data folder needs a dataset.json")
    return _check_meta(path.read_text(), path)


def _remote_meta(root: str, options: dict) -> tuple[dict, str, str | None]:
    """The checked ``dataset.json`` of the folder at URL ``root``, its URL, and the offline note if any."""
    url = f"{root.rstrip('/')}/dataset.json"
    notes: list[str] = []
    try:
        files = localize([{"dataset": url}], **{"progress": False, **options}, on_offline=notes.append)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{url} not found: an MSD data folder needs a dataset.json") from e
    return _check_meta(Path(files[0]["dataset"]).read_text(), url), url, (notes[0] if notes else None)


def _check_meta(text: str, path: str | Path) -> dict:
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise MSDDataError(f"{path} is not valid JSON: {e}") from e
    training = meta.get("training") if isinstance(meta, dict) else None
    if not isinstance(training, list) or not training:
        raise MSDDataError(f"{path} has no non-empty 'training' list")
    for i, item in enumerate(training):
        if not isinstance(item, dict) or "image" not in item or "label" not in item:
            raise MSDDataError(f"{path}: training[{i}] must have 'image' and 'label', got {item!r}")
        for key in ("image", "label"):
            if not isinstance(item[key], str):
                raise MSDDataError(
                    f"{path}: training[{i}][{key!r}] must be one file path, got {type(item[key]).__name__} "
                    f"{item[key]!r} (channels go into one file, as in Task01_BrainTumour)"
                )
    return meta


def _items(root: str | os.PathLike, remote_options: Mapping[str, Any] | None) -> tuple[list[dict[str, str]], str]:
    """The listed training pairs as local paths (fetched first when ``root`` is a URL), and where they are listed."""
    if not is_url(str(root)):
        read_dataset_json(root)  # its checks, each naming the file, before MONAI reads the list
        listing = Path(root).resolve() / "dataset.json"
        listed = load_decathlon_datalist(listing, is_segmentation=True, data_list_key="training")
        return [{k: d[k] for k in ("image", "label")} for d in listed], str(Path(root) / "dataset.json")
    options = dict(remote_options or {})
    meta, listing, offline_meta = _remote_meta(str(root), options)
    base = str(root).rstrip("/")
    pairs = [
        {k: d[k] if is_url(d[k]) else f"{base}/{d[k].removeprefix('./')}" for k in ("image", "label")}
        for d in meta["training"]
    ]
    notes: list[str] = []
    files = localize(pairs, **options, on_offline=notes.append)
    if notes or offline_meta:  # one warning for the listing and its files
        logger.warning(notes[0] if notes else offline_meta)
    return files, listing


def _spatial_shape(path: Path) -> tuple[int, ...]:
    """The first three sizes (a channels-last image's channels left out), from the header only."""
    try:
        return tuple(int(s) for s in nib.load(str(path)).shape)[:3]
    except Exception as e:  # nibabel raises several types for unreadable files
        raise MSDDataError(f"cannot read {path}: {e}") from e


def load_msd_datalist(
    root: str | os.PathLike,
    val_fraction: float = 0.2,
    seed: int = 0,
    val_cases: Sequence[str] | None = None,
    check_shapes: bool = True,
    remote_options: Mapping[str, Any] | None = None,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Read an MSD folder and split its training cases into train and validation lists.

    Args:
        root: folder holding ``dataset.json``, ``imagesTr/`` and ``labelsTr/``, or its fsspec URL (`localize()`).
        val_fraction, seed: share of cases validated on when ``val_cases`` is not given (at least one case
            each side); seed of the split.
        val_cases: the user's own fold: case or image file names to validate on; unknown ones are an error.
        check_shapes: compare each image's spatial shape with its label's (header reads only).
        remote_options: keyword arguments for `localize()` when ``root`` is a URL.

    Returns:
        ``(train_files, val_files)``: ``{"image", "label"}`` dicts with absolute paths, in ``dataset.json``'s order.

    Raises:
        FileNotFoundError, RemoteDataError: a missing folder, listing or file; a URL that cannot be fetched.
        MSDDataError: a malformed listing, unreadable file, shape mismatch, unknown case or an empty side.

    Examples:
        >>> train, val = load_msd_datalist("/data/Task09_Spleen", val_fraction=0.2, seed=0)  # doctest: +SKIP
    """
    items, listing = _items(root, remote_options)

    if missing := [p for d in items for p in (d["image"], d["label"]) if not Path(p).is_file()]:
        more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
        raise FileNotFoundError(f"{listing} lists files that do not exist: {', '.join(missing[:10])}{more}")
    if check_shapes:
        for d in items:
            shapes = _spatial_shape(Path(d["image"])), _spatial_shape(Path(d["label"]))
            if mismatch := shape_mismatch(d["image"], shapes[0], d["label"], shapes[1]):
                raise MSDDataError(mismatch)

    ids = [case_id(d["image"]) for d in items]
    if val_cases is not None:
        wanted = {case_id(c) for c in val_cases}
        if unknown := sorted(wanted - set(ids)):
            raise MSDDataError(f"val_cases not listed in {listing}: {unknown}")
        val_idx = [i for i, c in enumerate(ids) if c in wanted]
    else:
        if not 0.0 < val_fraction < 1.0:
            raise MSDDataError(f"val_fraction must be in (0, 1), got {val_fraction}")
        n_val = min(max(1, round(len(items) * val_fraction)), len(items) - 1)
        _, val_idx = partition_dataset(range(len(items)), ratios=[len(items) - n_val, n_val], shuffle=True, seed=seed)
    chosen = set(val_idx)
    train = [d for i, d in enumerate(items) if i not in chosen]
    val = [d for i, d in enumerate(items) if i in chosen]
    if not train or not val:
        raise MSDDataError(
            f"split of {len(items)} cases in {root} leaves {len(train)} for training and {len(val)} for validation"
        )
    return train, val
