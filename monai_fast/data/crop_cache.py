"""A disk cache that random crops read by the patch: data sets beyond RAM at near-RAM speed (docs/data.md)."""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from monai.data import MetaTensor
from monai.transforms import (
    Compose,
    RandCropByLabelClassesd,
    RandCropByPosNegLabeld,
    RandSpatialCropd,
    RandSpatialCropSamplesd,
)
from monai.transforms.compose import execute_compose
from monai.transforms.utils import map_binary_to_indices, map_classes_to_indices

from monai_fast.data.items import named_item_errors
from monai_fast.data.persistent import ItemKeys, chain_key, first_random
from monai_fast.files import clean_stale_tmp, no_space_in, tmp_path_for

__all__ = ["CropCacheDataset", "PATCH_CROPS", "flat_transforms", "index_bytes"]

logger = logging.getLogger("monai_fast.data")

#: random crops that read only their patch from the mapped arrays
PATCH_CROPS = (RandCropByPosNegLabeld, RandCropByLabelClassesd, RandSpatialCropd, RandSpatialCropSamplesd)

_FG, _BG, _CLASSES = "__crop_cache_fg__", "__crop_cache_bg__", "__crop_cache_classes__"
_ITEM = "item.json"


class CropCacheDataset(torch.utils.data.Dataset):
    """Items whose deterministic transforms ran once and were written as raw arrays, read back by the patch.

    Each item is ``.npy`` arrays plus ``item.json`` (no pickle), memory-mapped, keyed as in
    `TrustedPersistentDataset`, and written on first access (`fill()`: all).

    Args:
        data: items, e.g. ``{"image": path, "label": path}``.
        transform: the chain; everything before its first random transform is cached.
        cache_dir: the cache folder (created); items of other chains and files can share it.
        identity: ``"stat"`` (size and modification time) or ``"content"`` (SHA-1 of the bytes).

    Attributes:
        reads_patches: whether the first random transform is a crop that reads only its patch.
        disk_full: the ``OSError`` once the cache folder filled up (items then computed in memory), else ``None``.

    Examples:
        >>> ds = CropCacheDataset(files, transforms, "/scratch/crops")  # doctest: +SKIP
    """

    def __init__(
        self,
        data: Sequence[Mapping[str, Any]],
        transform: Compose | Sequence[Callable],
        cache_dir: str | os.PathLike,
        identity: Literal["stat", "content"] = "stat",
    ) -> None:
        self.item_key = ItemKeys(identity)  # refuses an unknown identity
        if cache_dir is None or str(cache_dir) == "":
            raise ValueError("cache_dir is required: the folder that holds the cached arrays")
        self.data = list(data)
        self.transform = transform if isinstance(transform, Compose) else Compose(list(transform))
        self.cache_dir = Path(cache_dir)
        self.identity = identity
        self.disk_full: OSError | None = None
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(self.cache_dir)  # item folders of killed writers
        flat = flat_transforms(self.transform)
        first = first_random(flat)
        self.prefix, self.suffix = flat[:first], flat[first:]
        crop = self.suffix[0] if self.suffix and isinstance(self.suffix[0], PATCH_CROPS) else None
        self.reads_patches = crop is not None
        self._indices = _indices_plan(crop)
        self._user_crop = crop
        if self._indices is not None:  # a copy that reads stored indices; its random state is the user's crop's
            crop = copy.copy(crop)
            if self._indices["kind"] == "posneg":
                crop.fg_indices_key, crop.bg_indices_key = _FG, _BG
            else:
                crop.indices_key = _CLASSES
            self.suffix = [crop, *self.suffix[1:]]
        self.chain_key, _ = chain_key([*self.prefix, self._indices], "CropCacheDataset", "items", self.cache_dir)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        return self.random_part(self.cached(index))

    def random_part(self, item: dict) -> Any:
        """The chain's random transforms over a `cached()` item (a crop reading the stored indices)."""
        if self._indices is not None:  # the user's set_random_state replaces the crop's generators
            self.suffix[0].R, self.suffix[0].cropper = self._user_crop.R, self._user_crop.cropper
        return self._run(item, self.suffix)

    def _run(self, item: Any, transforms: list) -> Any:
        """``transforms`` over ``item`` with the settings of the user's ``Compose``, failures named."""
        with named_item_errors(item):
            return execute_compose(
                item,
                transforms,
                map_items=self.transform.map_items,
                unpack_items=self.transform.unpack_items,
                lazy=self.transform.lazy,
                overrides=self.transform.overrides,
            )

    def fill(self, indices: Sequence[int] | None = None) -> int:
        """Compute and write the items not yet in the cache (all, or those of ``indices``); returns how many."""
        written = 0
        for i in range(len(self)) if indices is None else indices:
            if not self.item_dir(i).is_dir():
                written += self._write(i, self._prefix(i)) is not None
        return written

    def item_dir(self, index: int) -> Path:
        """The folder that holds item ``index``'s arrays and ``item.json``."""
        return self.cache_dir / f"{self.item_key(self.data[index]).decode()}-{self.chain_key}"

    def _prefix(self, index: int) -> dict:
        out = self._run(copy.deepcopy(self.data[index]), self.prefix)
        if not isinstance(out, Mapping):
            raise TypeError(
                f"CropCacheDataset: the deterministic transforms of item {index} return a {type(out).__name__}, "
                "not a dict; it caches dictionary items (the MONAI ``...d`` transforms)"
            )
        return dict(out)

    def cached(self, index: int) -> dict:
        """Item ``index`` after the cached transforms, memory-mapped from its folder (written first if need be)."""
        folder = self.item_dir(index)
        if folder.is_dir():
            try:
                return _read(folder)
            except (OSError, ValueError, KeyError) as err:  # damaged: rebuilt, never trained on
                logger.warning("CropCacheDataset: cached item %s is damaged (%s); rebuilding it", folder, err)
                shutil.rmtree(folder, ignore_errors=True)
        out = self._prefix(index)
        written = self._write(index, out)
        if written is not None:
            return _read(written)
        return out if self._indices is None else {**out, **_indices_of(out, self._indices)}  # the keys the crop reads

    def _write(self, index: int, out: dict) -> Path | None:
        """Write ``out`` as item ``index``; its folder, or ``None`` when the disk is full."""
        folder = self.item_dir(index)
        if self.disk_full is not None:
            return None
        tmp = tmp_path_for(folder)
        try:
            tmp.mkdir(parents=True)
            record: dict[str, Any] = {"keys": {}, "indices": None}
            for n, (key, value) in enumerate(out.items()):
                if not isinstance(key, str):
                    raise TypeError(f"key {key!r} of item {index} is not a string")
                if isinstance(value, (torch.Tensor, np.ndarray)):
                    np.save(tmp / f"a{n}.npy", _as_numpy(value))
                    entry: dict[str, Any] = {"array": f"a{n}.npy", "tensor": isinstance(value, torch.Tensor)}
                    if isinstance(value, MetaTensor):
                        entry["meta"] = _encode(dict(value.meta), f"{key}.meta")
                        ops = list(value.applied_operations)
                        entry["applied_operations"] = _encode(ops, f"{key}.applied_operations")
                    record["keys"][key] = entry
                else:
                    record["keys"][key] = {"value": _encode(value, key)}
            if self._indices is not None:
                stored = {}
                for name, value in _indices_of(out, self._indices).items():
                    arrays = value if isinstance(value, list) else [value]
                    files = []
                    for c, arr in enumerate(arrays):
                        np.save(tmp / f"{name}{c}.npy", _as_numpy(arr).astype(np.int64, copy=False))
                        files.append(f"{name}{c}.npy")
                    stored[name] = {"files": files, "list": isinstance(value, list)}
                record["indices"] = stored
            (tmp / _ITEM).write_text(json.dumps(record))
            try:
                os.rename(tmp, folder)
            except OSError as err:  # another writer was first: its item is the same
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            return folder
        except OSError as err:
            full = no_space_in(err, self.cache_dir, native=True)  # numpy writes from C: before the partial item goes
            shutil.rmtree(tmp, ignore_errors=True)
            if full is None:
                raise
            self.disk_full = full
            logger.warning(
                "CropCacheDataset: the cache folder %s is full (%s); the items not yet cached are computed "
                "in memory from here on",
                self.cache_dir,
                os.strerror(full.errno or errno.ENOSPC),
            )
            return None
        except TypeError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise TypeError(f"CropCacheDataset: item {index} ({self.data[index]!r}) cannot be cached: {err}") from None
        except BaseException:  # Ctrl-C in a notebook: this live process's half-written item is not left behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def flat_transforms(chain: Compose) -> list:
    """``chain``'s transforms, nested ``Compose`` expanded (``Compose.flatten`` would reseed every transform)."""
    out = []
    for t in chain.transforms:
        out.extend(flat_transforms(t) if type(t) is Compose else [t])
    return out


def _indices_plan(crop: Any) -> dict | None:
    """The indices the crop needs precomputed, with its own settings; ``None`` when none."""
    if isinstance(crop, RandCropByPosNegLabeld) and (crop.fg_indices_key is None or crop.bg_indices_key is None):
        kind: dict[str, Any] = {"kind": "posneg"}
    elif isinstance(crop, RandCropByLabelClassesd) and crop.indices_key is None:
        kind = {
            "kind": "classes",
            "num_classes": crop.cropper.num_classes,
            "max_samples_per_class": crop.cropper.max_samples_per_class,
        }
    else:
        return None
    return {
        **kind,
        "label_key": crop.label_key,
        "image_key": crop.image_key,
        "image_threshold": float(crop.cropper.image_threshold),
    }


def index_bytes(crop: Any, item: Any) -> int:
    """Bytes of the int64 crop indices `CropCacheDataset` stores beside ``item`` (a cached part) for ``crop``: 0
    for a crop that needs none."""
    plan = _indices_plan(crop)
    if plan is None or not isinstance(item, Mapping):
        return 0
    found = _indices_of(item, plan).values()
    return sum(8 * int(np.asarray(a).size) for v in found for a in (v if isinstance(v, list) else [v]))


def _indices_of(out: Mapping, plan: dict) -> dict[str, Any]:
    """The indices the crop would compute from ``out``, with MONAI's functions."""
    label = out[plan["label_key"]]
    image = out.get(plan["image_key"]) if plan["image_key"] is not None else None
    if plan["kind"] == "posneg":
        fg, bg = map_binary_to_indices(label, image, plan["image_threshold"])
        return {_FG: fg, _BG: bg}
    classes = map_classes_to_indices(
        label, plan["num_classes"], image, plan["image_threshold"], plan["max_samples_per_class"]
    )
    return {_CLASSES: list(classes)}


def _read(folder: Path) -> dict:
    """Item ``folder`` as a dict of memory-mapped arrays (``MetaTensor`` where it was one) and values."""
    record = json.loads((folder / _ITEM).read_text())
    out: dict[str, Any] = {}
    for key, entry in record["keys"].items():
        if "array" not in entry:
            out[key] = _decode(entry["value"])
            continue
        array = np.load(folder / entry["array"], mmap_mode="c", allow_pickle=False)
        if not entry["tensor"]:
            out[key] = array
        elif "meta" in entry:
            out[key] = MetaTensor(
                torch.from_numpy(array),
                meta=_decode(entry["meta"]),
                applied_operations=_decode(entry["applied_operations"]),
            )
        else:
            out[key] = torch.from_numpy(array)
    for name, stored in (record.get("indices") or {}).items():
        arrays = [np.load(folder / f, mmap_mode="r", allow_pickle=False) for f in stored["files"]]
        out[name] = arrays if stored["list"] else arrays[0]
    return out


def _plain(value: torch.Tensor) -> torch.Tensor:
    """``value`` detached, on the CPU, as a plain tensor (no ``MetaTensor`` metadata)."""
    value = value.detach().cpu()
    return value.as_tensor() if isinstance(value, MetaTensor) else value


def _as_numpy(value: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(_plain(value).numpy() if isinstance(value, torch.Tensor) else value)


def _encode(value: Any, where: str) -> Any:
    """``value`` as JSON, with tensors, arrays and tuples tagged so that `_decode()` restores them."""
    if isinstance(value, torch.Tensor):
        value = _plain(value)
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                raise TypeError(f"{where} has a key {k!r} that is not a string")
        return {"__dict__": {k: _encode(v, f"{where}.{k}") for k, v in value.items()}}
    raise TypeError(f"{where} holds a {type(value).__name__}, which is not stored without pickle")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if "__ndarray__" in value:
        return np.array(value["__ndarray__"], dtype=np.dtype(value["dtype"]))
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    return {k: _decode(v) for k, v in value["__dict__"].items()}
