"""Synthetic 3D segmentation data in the Medical Segmentation Decathlon (MSD) layout; a seed writes the same bytes.

``spleen-like`` (after Task09_Spleen) or ``brats-like`` (after Task01_BrainTumour).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np

from monai_fast.files import clean_stale_tmp, write_bytes, write_json
from monai_fast.folders import cache_root
from monai_fast.progress import progress_bar

__all__ = [
    "KINDS",
    "brats_like_case",
    "generate_msd",
    "recorded_parameters",
    "smooth_field",
    "spleen_like_case",
    "synthetic_dataset",
    "unit_grid",
]

logger = logging.getLogger(__name__)

KINDS = ("spleen-like", "brats-like")

_DEFAULT_SPACING = {"spleen-like": (1.6, 1.6, 2.5), "brats-like": (1.0, 1.0, 1.0)}

_DESCRIPTIONS = {
    "spleen-like": {
        "name": "SpleenLike",
        "description": "Synthetic spleen-like CT segmentation (monai-fast), layout of MSD Task09_Spleen",
        "tensorImageSize": "3D",
        "modality": {"0": "CT"},
        "labels": {"0": "background", "1": "spleen"},
        "prefix": "spleen",
    },
    "brats-like": {
        "name": "BrainTumourLike",
        "description": "Synthetic brain-tumour-like MRI segmentation (monai-fast), layout of MSD Task01_BrainTumour",
        "tensorImageSize": "4D",
        "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
        "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"},
        "prefix": "BRATS",
    },
}


def unit_grid(shape: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Coordinates normalised to [-1, 1] along each axis (broadcastable, not materialised)."""
    return tuple(
        np.linspace(-1.0, 1.0, n, dtype=np.float32).reshape([-1 if i == a else 1 for i in range(len(shape))])
        for a, n in enumerate(shape)
    )


def smooth_field(
    rng: np.random.Generator, grid: Sequence[np.ndarray], n_waves: int = 4, max_freq: float = 3.0
) -> np.ndarray:
    """A smooth random field in about [-1, 1] on ``grid`` (`unit_grid()`): a sum of a few low-frequency plane waves."""
    field = np.zeros(np.broadcast_shapes(*(g.shape for g in grid)), dtype=np.float32)
    for _ in range(n_waves):
        k = rng.uniform(-max_freq, max_freq, size=len(grid)).astype(np.float32)
        phase = np.float32(rng.uniform(0, 2 * np.pi))
        field += np.cos(np.pi * sum(k[i] * g for i, g in enumerate(grid)) + phase)
    return field / np.float32(n_waves)


def _blob(rng: np.random.Generator, grid, centre, radii, wobble: float = 0.25) -> np.ndarray:
    """Boolean mask of an ellipsoid whose surface is deformed by a smooth random field."""
    x, y, z = grid
    r = ((x - centre[0]) / radii[0]) ** 2 + ((y - centre[1]) / radii[1]) ** 2 + ((z - centre[2]) / radii[2]) ** 2
    return (np.sqrt(r) + wobble * smooth_field(rng, grid, max_freq=2.0)) < 1.0


def _affine(spacing: Sequence[float], shape: Sequence[int], lps: bool) -> np.ndarray:
    """A scanner-like affine: given spacing, centred at the origin, LPS-like if ``lps`` (x, y flipped)."""
    sign = np.array([-1.0, -1.0, 1.0]) if lps else np.ones(3)
    aff = np.eye(4)
    aff[:3, :3] = np.diag(sign * np.asarray(spacing, dtype=float))
    aff[:3, 3] = -aff[:3, :3] @ (np.asarray(shape, dtype=float) / 2.0)
    return aff


def spleen_like_case(rng: np.random.Generator, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """One CT-like volume (``int16``, HU) and its spleen label (``uint8``), both of ``shape``."""
    g = unit_grid(shape)
    x, y, z = g
    img = np.full(tuple(shape), -1000.0, dtype=np.float32)  # air
    # body: an elliptic cylinder with a fat rim, slightly varying in size along z
    bx, by = rng.uniform(0.78, 0.9), rng.uniform(0.62, 0.75)
    body_r = (x / bx) ** 2 + (y / by) ** 2 + 0.0 * z
    img[body_r < 1.0] = -100.0  # subcutaneous fat
    img[body_r < 0.8] = 35.0  # soft tissue
    # spine: a bright disc posterior (large y), all along z
    img[((x / 0.09) ** 2 + ((y - 0.45 * by) / 0.09) ** 2 + 0.0 * z) < 1.0] = 650.0
    # liver-like distractor on the patient's right (image left), darker than the spleen
    liver = _blob(rng, g, (-0.35, -0.05, rng.uniform(-0.2, 0.2)), (0.32, 0.3, 0.7), wobble=0.2)
    img[liver] = 55.0
    # the spleen: a smaller, brighter blob on the other side, position and size vary per case
    centre = (rng.uniform(0.25, 0.42), rng.uniform(-0.1, 0.15), rng.uniform(-0.25, 0.25))
    radii = (rng.uniform(0.16, 0.22), rng.uniform(0.18, 0.26), rng.uniform(0.3, 0.45))
    spleen = _blob(rng, g, centre, radii, wobble=0.25) & (body_r < 0.8)
    img[spleen] = 115.0
    # smooth intensity inhomogeneity plus scanner noise
    img += 12.0 * smooth_field(rng, g, n_waves=3, max_freq=1.5)
    img += rng.normal(0.0, 18.0, size=img.shape).astype(np.float32)
    return np.clip(np.round(img), -1024, 3071).astype(np.int16), spleen.astype(np.uint8)


def brats_like_case(rng: np.random.Generator, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """One four-channel MRI-like volume (``float32``, channels last as in MSD) and its label."""
    g = unit_grid(shape)
    x, y, z = g
    brain = _blob(rng, g, (0.0, 0.0, 0.0), (0.8, 0.88, 0.8), wobble=0.05)
    centre = (rng.uniform(-0.35, 0.35), rng.uniform(-0.35, 0.35), rng.uniform(-0.3, 0.3))
    base = rng.uniform(0.28, 0.4, size=3)
    edema = _blob(rng, g, centre, base, wobble=0.2) & brain
    core = _blob(rng, g, centre, base * 0.6, wobble=0.15) & edema
    enhancing = core & ~_blob(rng, g, centre, base * 0.35, wobble=0.1)  # a rim inside the core
    label = np.zeros(tuple(shape), dtype=np.uint8)
    label[edema] = 1
    label[core] = 2
    label[enhancing] = 3
    # (FLAIR, T1w, T1gd, T2w) intensities per class: background, brain, edema, core, enhancing
    table = np.array(
        [
            [0.0, 300.0, 700.0, 500.0, 600.0],
            [0.0, 500.0, 380.0, 330.0, 360.0],
            [0.0, 500.0, 400.0, 350.0, 900.0],
            [0.0, 400.0, 800.0, 650.0, 700.0],
        ],
        dtype=np.float32,
    )
    cls = np.where(brain, 1, 0).astype(np.int64)
    cls[label > 0] = label[label > 0].astype(np.int64) + 1
    channels = []
    for c in range(4):
        ch = table[c][cls]
        ch *= 1.0 + 0.1 * smooth_field(rng, g, n_waves=3, max_freq=1.5)  # bias field
        ch += rng.normal(0.0, 25.0, size=ch.shape).astype(np.float32) * brain
        channels.append(np.clip(ch, 0.0, None))
    return np.stack(channels, axis=-1).astype(np.float32), label


def _save_atomic(array: np.ndarray, affine: np.ndarray, path: Path) -> None:
    img = nib.Nifti1Image(array, affine)
    img.header.set_xyzt_units("mm")
    data = img.to_bytes() if not path.name.endswith(".gz") else gzip.compress(img.to_bytes(), compresslevel=1, mtime=0)
    write_bytes(data, path, clean=False)  # generate_msd cleans each folder once


def generate_msd(
    root: str | os.PathLike,
    kind: str = "spleen-like",
    num_cases: int = 16,
    shape: Sequence[int] = (128, 128, 64),
    spacing: Sequence[float] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Write a synthetic data set in MSD layout: ``imagesTr/``, ``labelsTr/`` and ``dataset.json`` (last, atomically).

    Args:
        root, kind: output folder (created if missing); ``"spleen-like"`` or ``"brats-like"``.
        num_cases, shape: number of image + label pairs; spatial shape of every volume, in voxels.
        spacing: voxel size in mm; default 1.6 x 1.6 x 2.5 (spleen-like) or 1 mm (brats-like).
        seed, progress: random seed (the same seed writes the same data); show a progress bar.

    Returns:
        The data set folder, ready for `load_msd_datalist()`; an unknown ``kind`` or bad size is a ``ValueError``.

    Examples:
        >>> root = generate_msd("/tmp/spleen_like", kind="spleen-like", num_cases=4, shape=(64, 64, 32))
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    if num_cases < 1:
        raise ValueError(f"num_cases must be >= 1, got {num_cases}")
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or min(shape) < 8:
        raise ValueError(f"shape must be three sizes >= 8, got {shape}")
    spacing = tuple(float(s) for s in (spacing or _DEFAULT_SPACING[kind]))
    if len(spacing) != 3 or min(spacing) <= 0:
        raise ValueError(f"spacing must be three positive sizes in mm, got {spacing}")

    root = Path(root)
    meta = _DESCRIPTIONS[kind]
    for sub in ("imagesTr", "labelsTr"):
        (root / sub).mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(root / sub)  # leftovers of a killed earlier run
    make_case = spleen_like_case if kind == "spleen-like" else brats_like_case
    affine = _affine(spacing, shape, lps=(kind == "spleen-like"))
    training = []
    for i in progress_bar(range(num_cases), enabled=progress, desc=f"writing {kind} cases", leave=False):
        rng = np.random.default_rng([seed, i])
        image, label = make_case(rng, shape)
        name = f"{meta['prefix']}_{i + 1:03d}.nii.gz"
        _save_atomic(image, affine, root / "imagesTr" / name)
        _save_atomic(label, affine, root / "labelsTr" / name)
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})

    dataset = {
        "name": meta["name"],
        "description": meta["description"],
        "reference": "monai-fast synthetic generator",
        "licence": "CC-BY-SA 4.0",
        "release": "1.0",
        "tensorImageSize": meta["tensorImageSize"],
        "modality": meta["modality"],
        "labels": meta["labels"],
        "numTraining": num_cases,
        "numTest": 0,
        "training": training,
        "test": [],
        "monai_fast": {"kind": kind, "shape": list(shape), "spacing": list(spacing), "seed": seed},
    }
    write_json(dataset, root / "dataset.json")
    logger.info("wrote %d %s cases to %s", num_cases, kind, root)
    return root


def recorded_parameters(root: Path) -> dict:
    """The parameters ``root/dataset.json`` was written for (its ``monai_fast`` key); ``{}`` if missing or damaged."""
    try:
        meta = json.loads((root / "dataset.json").read_text()).get("monai_fast")
    except (OSError, json.JSONDecodeError, AttributeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def synthetic_dataset(kind: str, cases: int, shape: Sequence[int], seed: int, progress: bool = True) -> Path:
    """The synthetic set for these parameters, written once under ``<cache_root()>/data`` and reused (written
    again when its ``dataset.json`` is missing, damaged or for other parameters)."""
    shape = tuple(int(s) for s in shape)
    root = cache_root() / "data" / f"{kind}-n{cases}-{'x'.join(map(str, shape))}-s{seed}"
    meta = recorded_parameters(root)
    if {k: meta.get(k) for k in ("shape", "seed", "kind")} == {"shape": list(shape), "seed": seed, "kind": kind}:
        logger.info("reusing synthetic data in %s", root)
        return root
    logger.info("writing %d %s cases to %s", cases, kind, root)
    return generate_msd(root, kind=kind, num_cases=cases, shape=shape, seed=seed, progress=progress)
