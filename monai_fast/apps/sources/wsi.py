"""Synthetic whole-slide images (WSI) for patch classification, laid out like Camelyon16 (docs/pathology.md)."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from monai_fast.apps.sources.synthetic import recorded_parameters, smooth_field, unit_grid
from monai_fast.extras import require
from monai_fast.files import atomic_write, clean_stale_tmp, write_json, write_text
from monai_fast.folders import cache_root
from monai_fast.progress import progress_bar

__all__ = [
    "MASK_DOWNSAMPLE",
    "WSIDataError",
    "generate_wsi",
    "load_wsi_datalist",
    "synthetic_wsi_dataset",
    "wsi_like_slide",
]

logger = logging.getLogger(__name__)

#: the masks are stored at this fraction of level 0 (level-0 sizes must be multiples of it)
MASK_DOWNSAMPLE = 16
_BACKGROUND = np.array([242, 240, 245], dtype=np.float32)
_STROMA = np.array([228, 158, 196], dtype=np.float32)
_NUCLEUS = np.array([96, 58, 150], dtype=np.float32)
_TUMOUR_NUCLEUS = np.array([82, 46, 136], dtype=np.float32)


class WSIDataError(ValueError):
    """A WSI data set folder that cannot be used; the message names the file and the key at fault."""


def _masks(rng: np.random.Generator, coarse: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Tissue and tumour masks (bool) on the coarse grid: a lobed tissue section, 1-3 tumour blobs inside it."""
    y, x = unit_grid(coarse)
    radius = np.sqrt((y / 0.85) ** 2 + (x / 0.85) ** 2)
    tissue = radius + 0.3 * smooth_field(rng, (y, x), n_waves=5, max_freq=2.5) < 0.9
    tumour = np.zeros(coarse, dtype=bool)
    for _ in range(int(rng.integers(1, 4))):
        cy, cx = rng.uniform(-0.45, 0.45, size=2)
        ry, rx = rng.uniform(0.15, 0.3, size=2)
        r = np.sqrt(((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2)
        tumour |= r + 0.25 * smooth_field(rng, (y, x), n_waves=5, max_freq=3.0) < 1.0
    return tissue, tumour & tissue


def _nuclei(rng: np.random.Generator, shape: tuple[int, int], cell: int, density: float | np.ndarray) -> np.ndarray:
    """Square "nuclei" of ``cell`` pixels: each cell of a ``cell``-pixel grid holds one with probability ``density``."""
    grid = (-(-shape[0] // cell), -(-shape[1] // cell))
    seeds = rng.random(grid, dtype=np.float32) < density
    return np.repeat(np.repeat(seeds, cell, axis=0), cell, axis=1)[: shape[0], : shape[1]]


def wsi_like_slide(rng: np.random.Generator, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One H&E-like slide at level 0 (``uint8``, H x W x 3) and its tissue and tumour masks (bool, coarse).

    The masks have shape ``size // MASK_DOWNSAMPLE``; the slide is rendered in bands of rows to bound memory.
    """
    h, w = size
    coarse = (h // MASK_DOWNSAMPLE, w // MASK_DOWNSAMPLE)
    tissue_c, tumour_c = _masks(rng, coarse)
    # staining varies across the slide
    shade_c = 1.0 + 0.08 * smooth_field(rng, unit_grid(coarse), n_waves=5, max_freq=4.0)
    stain = rng.uniform(0.9, 1.1, size=3).astype(np.float32)  # ... and from slide to slide
    normal_density, tumour_density = rng.uniform(0.05, 0.09), rng.uniform(0.11, 0.16)
    slide = np.empty((h, w, 3), dtype=np.uint8)
    band = MASK_DOWNSAMPLE * max(1, 1024 // MASK_DOWNSAMPLE)
    for r0 in range(0, h, band):
        rows = slice(r0 // MASK_DOWNSAMPLE, min(h, r0 + band) // MASK_DOWNSAMPLE)
        tissue, tumour, shade = (
            np.repeat(np.repeat(m[rows], MASK_DOWNSAMPLE, axis=0), MASK_DOWNSAMPLE, axis=1)
            for m in (tissue_c, tumour_c, shade_c)
        )
        shape = tissue.shape
        img = np.broadcast_to(_BACKGROUND, (*shape, 3)).copy()
        img[tissue] = _STROMA * stain
        img[_nuclei(rng, shape, 4, normal_density) & tissue & ~tumour] = _NUCLEUS * stain
        img[_nuclei(rng, shape, 5, tumour_density) & tumour] = _TUMOUR_NUCLEUS * stain
        img *= shade[..., None]
        img += rng.normal(0.0, 10.0, size=img.shape).astype(np.float32)
        slide[r0 : r0 + shape[0]] = np.clip(img, 0, 255).astype(np.uint8)
    return slide, tissue_c, tumour_c


def _pyramid(level0: np.ndarray, levels: int) -> list[np.ndarray]:
    """Level 0 and ``levels - 1`` levels each half the size of the one before (2 x 2 means)."""
    out = [level0]
    for _ in range(levels - 1):
        a = out[-1]
        h, w = a.shape[0] // 2 * 2, a.shape[1] // 2 * 2
        s = a[:h:2, :w:2].astype(np.uint16) + a[1:h:2, :w:2] + a[:h:2, 1:w:2] + a[1:h:2, 1:w:2]
        out.append(((s + 2) // 4).astype(np.uint8))
    return out


def _write_tiff(path: Path, levels: list[np.ndarray], tile: int) -> None:
    """A tiled TIFF, one page per level (reduced-resolution pages after the first), atomically."""
    tifffile = require("tifffile", extra="wsi", feature=f"writing the slide {path}")

    with atomic_write(path, "wb", clean=False) as f, tifffile.TiffWriter(f) as tif:  # generate_wsi cleans the folder
        for i, a in enumerate(levels):
            tiled = {"tile": (tile, tile)} if min(a.shape[:2]) >= tile else {}
            tif.write(
                a, photometric="rgb" if a.ndim == 3 else "minisblack", subfiletype=1 if i else 0, metadata=None, **tiled
            )


def _patches(tissue: np.ndarray, tumour: np.ndarray, size: tuple[int, int], patch: int) -> list[tuple[int, int, int]]:
    """``(row, col, label)`` centres at level 0 of the patches on a ``patch``-pixel grid that are mostly tissue
    and either at least half tumour (1) or free of it (0)."""
    up = [np.repeat(np.repeat(m, MASK_DOWNSAMPLE, axis=0), MASK_DOWNSAMPLE, axis=1) for m in (tissue, tumour)]
    nh, nw = size[0] // patch, size[1] // patch
    t_frac, c_frac = (m[: nh * patch, : nw * patch].reshape(nh, patch, nw, patch).mean(axis=(1, 3)) for m in up)
    out = []
    for i, j in zip(*np.nonzero(t_frac >= 0.5)):
        if c_frac[i, j] >= 0.5 or c_frac[i, j] == 0.0:
            out.append((int(i * patch + patch // 2), int(j * patch + patch // 2), int(c_frac[i, j] >= 0.5)))
    return out


def _check(num_slides: int, size: Sequence[int], tile: int, levels: int, patch_size: int) -> tuple[int, int]:
    """The level-0 size, after checking every option; a bad one is named."""
    if num_slides < 2:
        raise ValueError(f"num_slides must be >= 2 (training and validation slides), got {num_slides}")
    size = tuple(int(s) for s in size)
    if len(size) != 2 or min(size) < 128 or any(s % MASK_DOWNSAMPLE for s in size):
        raise ValueError(
            f"size must be two sizes (rows, columns) >= 128 and multiples of {MASK_DOWNSAMPLE}, got {size}"
        )
    if tile < 16 or tile % 16:
        raise ValueError(f"tile must be a multiple of 16 (a TIFF rule), got {tile}")
    if not 1 <= levels <= 8 or min(size) >> (levels - 1) < 16:
        raise ValueError(f"levels must be 1..8 and leave the smallest level >= 16 pixels, got {levels} for size {size}")
    if not 8 <= patch_size <= min(size) // 4:
        raise ValueError(
            f"patch_size must be between 8 and a quarter of the slide ({min(size) // 4}), got {patch_size}"
        )
    return size  # type: ignore[return-value]


def _params(num_slides: int, size: Sequence[int], tile: int, levels: int, patch_size: int, seed: int) -> dict:
    """The parameters a generated set records under ``dataset.json``'s ``monai_fast`` key, to be reused by."""
    return {
        "kind": "wsi",
        "num_slides": num_slides,
        "size": [int(s) for s in size],
        "tile": tile,
        "levels": levels,
        "patch_size": patch_size,
        "seed": seed,
        "mask_downsample": MASK_DOWNSAMPLE,
    }


def generate_wsi(
    root: str | os.PathLike,
    num_slides: int = 4,
    size: Sequence[int] = (4096, 4096),
    tile: int = 256,
    levels: int = 3,
    patch_size: int = 96,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Write a synthetic WSI data set: ``slides/``, ``masks/``, ``patches.csv`` and ``dataset.json`` (written last).

    Args:
        root, num_slides: output folder (created if missing); slides to write (>= 2), the last quarter of them
            (at least one) for validation.
        size, tile, levels: level-0 size (rows, columns) in multiples of `MASK_DOWNSAMPLE`; TIFF tile size (a
            multiple of 16); pyramid levels, each half the size of the one before.
        patch_size: patch size at level 0 of the patch grid in ``patches.csv`` / ``dataset.json``.
        seed, progress: random seed (the same seed writes the same data); show a progress bar.

    Returns:
        The data set folder, ready for `load_wsi_datalist()`.

    Raises:
        ValueError, MissingExtraError: a bad option, named; no ``tifffile`` (the ``wsi`` extra), before any write.

    Examples:
        >>> root = generate_wsi("/tmp/wsi_like", num_slides=2, size=(512, 512))  # doctest: +SKIP
    """
    size = _check(num_slides, size, tile, levels, patch_size)
    require("tifffile", extra="wsi", feature="writing synthetic whole-slide images")
    root = Path(root)
    for sub in ("slides", "masks"):
        (root / sub).mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(root / sub)
    n_val = max(1, num_slides // 4)
    lists: dict[str, list[dict]] = {"training": [], "validation": []}
    rows, slides = [], []
    for i in progress_bar(range(num_slides), enabled=progress, desc="writing wsi-like slides", leave=False):
        name = f"slide_{i + 1:03d}"
        split = "validation" if i >= num_slides - n_val else "training"
        image, tissue, tumour = wsi_like_slide(np.random.default_rng([seed, i]), size)
        _write_tiff(root / "slides" / f"{name}.tif", _pyramid(image, levels), tile)
        masks = {}
        for mask, kind in ((tissue, "tissue"), (tumour, "tumor")):
            masks[f"{kind}_mask"] = f"masks/{name}_{kind}.tif"
            _write_tiff(root / masks[f"{kind}_mask"], [mask.astype(np.uint8) * 255], tile)
        for r, c, label in _patches(tissue, tumour, size, patch_size):
            lists[split].append({"image": f"slides/{name}.tif", "location": [r, c], "label": [label]})
            rows.append((name, c, r, label, split))
        slides.append({"name": name, "image": f"slides/{name}.tif", "split": split, **masks})
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([("image", "x", "y", "label", "split"), *rows])
    write_text(text.getvalue(), root / "patches.csv")
    params = _params(num_slides, size, tile, levels, patch_size, seed)
    write_json(
        {
            "name": "WSILike",
            "description": "Synthetic Camelyon-like whole-slide images (monai-fast)",
            "labels": {"0": "normal", "1": "tumor"},
            "slides": slides,
            **lists,
            "monai_fast": params,
        },
        root / "dataset.json",
    )
    counts = len(lists["training"]), len(lists["validation"])
    logger.info("wrote %d wsi-like slides (%d training / %d validation patches) to %s", num_slides, *counts, root)
    return root


def load_wsi_datalist(root: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """The training and validation patch lists of ``root/dataset.json``, image paths made absolute.

    Raises:
        WSIDataError: when ``dataset.json`` is missing or unreadable, a list or an item's key is
            missing, or a slide file does not exist; the message names the file and the key.
    """
    root = Path(root)
    path = root / "dataset.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WSIDataError(
            f"{path}: cannot read the WSI data set list ({e}); write one with 'monai-fast synth --kind wsi'"
        ) from e
    out: list[list[dict]] = []
    for key in ("training", "validation"):
        items = meta.get(key) if isinstance(meta, dict) else None
        if not isinstance(items, list) or not items:
            raise WSIDataError(f"{path}: key {key!r} must be a non-empty list of patches")
        for n, item in enumerate(items):
            if not isinstance(item, dict):
                raise WSIDataError(f"{path}: {key}[{n}] must be a patch entry (a mapping), got {item!r}")
            if missing := [k for k in ("image", "location", "label") if k not in item]:
                raise WSIDataError(f"{path}: {key}[{n}] has no {missing[0]!r}")
            if not isinstance(item["image"], str):
                raise WSIDataError(f"{path}: {key}[{n}]['image'] must be one slide path, got {item['image']!r}")
        images = {item["image"]: str((root / item["image"]).resolve()) for item in items}
        for rel, full in images.items():
            if not os.path.isfile(full):
                raise WSIDataError(f"{path}: {key} names slide {rel!r}, which does not exist ({full})")
        out.append([{**item, "image": images[item["image"]]} for item in items])
    return out[0], out[1]


def synthetic_wsi_dataset(
    num_slides: int,
    size: Sequence[int],
    patch_size: int,
    seed: int = 0,
    tile: int = 256,
    levels: int = 3,
    progress: bool = True,
) -> Path:
    """The synthetic WSI set for these parameters, written once under ``<cache_root()>/data`` and reused."""
    size = tuple(int(s) for s in size)
    want = _params(num_slides, size, tile, levels, patch_size, seed)
    root = cache_root() / "data" / f"wsi-n{num_slides}-{size[0]}x{size[1]}-p{patch_size}-t{tile}-l{levels}-s{seed}"
    if recorded_parameters(root) == want:
        logger.info("reusing synthetic WSI data in %s", root)
        return root
    return generate_wsi(
        root, num_slides, size, tile=tile, levels=levels, patch_size=patch_size, seed=seed, progress=progress
    )
