"""The Model Zoo sweep: each bundle whose train config builds a ``SupervisedTrainer``, run by ``monai-fast bundle run``.

For each bundle under ``ZOO/models`` (a Model Zoo checkout, or any folder holding bundles in its layout) whose
``configs/train.json`` or ``.yaml`` builds a ``SupervisedTrainer``, the sweep copies the bundle to a scratch folder,
writes synthetic data shaped like the bundle's inputs and runs ``monai-fast bundle run`` on it in its own process
group with a time limit, so that a crash or a hang is a row of the table, never the end of the sweep.

The synthetic data follows the bundle itself: the keys its ``LoadImaged`` reads, the channels and spatial dimensions
of ``configs/metadata.json`` (``network_data_format``), the classes of its output, the voxel spacing of its
``Spacingd`` (so that no resampling changes the size), and the file type its config names (NIfTI for 3-D, PNG or
JPEG for 2-D images, ``.npy`` where the config reads NumPy files). Overridden are only: the training and validation
data lists (found by following the trainer's ``train_data_loader`` and the evaluator's ``val_data_loader`` to their
data sets' ``data``), the epochs (one epoch of two iterations: ``train#trainer#max_epochs`` and
``train#trainer#epoch_length``), the device (CPU), a training batch above 2 (down to 2) and the per-bundle sizes a
small CPU cannot hold, listed in :data:`CPU_SIZES` with their reason. A published bundle's own defect that stops
it training with the MONAI installed here is worked around by an override both variants get, listed in
:data:`BUNDLE_FIXES` with the defect named in the row. Nothing is downloaded.

A row says: ``builds`` (the trainer was made and FastTraining attached), ``trains`` (at least two training
iterations ran, read from the run record), the levers FastTraining applied (from the record), and the reason where
not (the last line of the error, or the time limit). With ``--speedup-epochs E``, each bundle that trains is then
run ``--repeats`` times as published and with ``monai-fast bundle run``, taking turns, each run in its own process
(``benchmarks/bundle.py``'s runs), for E epochs: the row's per-epoch speed-up is the median over pairs of the
published per-epoch time (training and validation, from the run record, the first epoch left out) over the fast one.

    python benchmarks/bundle_sweep.py --zoo /path/to/model-zoo                  # all bundles, 300 s each
    python benchmarks/bundle_sweep.py --zoo /path/to/model-zoo --speedup-epochs 3 --repeats 2
    python benchmarks/bundle_sweep.py --zoo /path/to/model-zoo --bundles spleen_ct_segmentation --timeout 120
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from monai_fast.files import write_json
from monai_fast.telemetry import device_description
from monai_fast.telemetry.precision import cpu_has_bf16_hardware

ROOT = Path(__file__).resolve().parents[1]


__all__ = [
    "BUNDLE_FIXES",
    "CPU_SIZES",
    "Prepared",
    "SweepRow",
    "find_bundles",
    "measure_speedup",
    "prepare",
    "run_prepared",
    "sweep",
    "table",
]

TRAIN_NAMES = ("train.json", "train.yaml", "train.yml")
LOADERS = ("LoadImaged", "LoadImage")

#: Per-bundle sizes a small CPU cannot hold, with the reason: only sizes, never the algorithm. ``volume`` is the
#: synthetic images' shape, ``set`` the size overrides (patches, windows) that go with it, ``timeout`` the seconds
#: a run may take at the least.
CPU_SIZES: dict[str, dict[str, Any]] = {
    "spleen_ct_segmentation": {
        "volume": [64, 64, 64],
        "set": {"train#random_transforms#0#spatial_size": [64, 64, 64], "validate#inferer#roi_size": [64, 64, 64]},
        "why": "64^3 volumes, patches and windows",
    },
    "swin_unetr_btcv_segmentation": {
        "volume": [64, 64, 64],
        "set": {"train#random_transforms#0#spatial_size": [64, 64, 64], "validate#inferer#roi_size": [64, 64, 64]},
        "timeout": 300,
        "why": "96^3 SwinUNETR windows: 64^3 volumes, patches and windows",
    },
    "wholeBody_ct_segmentation": {
        "volume": [64, 64, 64],
        "set": {
            "train#deterministic_transforms#6#k_divisible": [64, 64, 64],
            "validate#preprocessing#transforms#6#k_divisible": [64, 64, 64],
            "train#random_transforms#0#roi_size": [64, 64, 64],
            "validate#inferer#roi_size": [64, 64, 64],
        },
        "timeout": 400,
        "why": "whole-body volumes: 64^3 volumes, patches and windows",
    },
    "brats_mri_segmentation": {
        "volume": [96, 96, 64],
        "set": {"validate#inferer#roi_size": [96, 96, 64]},
        "why": "240x240x155 volumes: 96x96x64, and windows of that size",
    },
}


def _brats_label_float(config: dict) -> dict[str, Any]:
    """The training chain with the label cast to float32 after ``ConvertToMultiChannelBasedOnBratsClassesd``."""
    chain = list(_get(config, "train#preprocessing_transforms"))
    at = next(i for i, t in enumerate(chain) if t.get("_target_") == "ConvertToMultiChannelBasedOnBratsClassesd")
    chain.insert(at + 1, {"_target_": "CastToTyped", "keys": "label", "dtype": "$torch.float32"})
    return {"train#preprocessing_transforms": chain}


def _no_img_size(config: dict) -> dict[str, Any]:
    """The network without ``img_size``, which MONAI 1.6's ``SwinUNETR`` does not take (any size divisible by 32)."""
    return {"network_def": {k: v for k, v in config["network_def"].items() if k != "img_size"}}


#: Defects of a published bundle that stop it training with the MONAI installed here, each worked around by an
#: override that both variants get: ``fix`` makes the overrides from the bundle's config, ``why`` names the defect.
BUNDLE_FIXES: dict[str, dict[str, Any]] = {
    "brats_mri_segmentation": {
        "fix": _brats_label_float,
        "why": (
            "the bundle's defect: ConvertToMultiChannelBasedOnBratsClassesd makes a bool label and its "
            "DiceLoss(squared_pred=True) takes torch.linalg.vector_norm of it, which MONAI 1.6 calls and which "
            "refuses bool; overridden: the label cast to float32 after that transform (training and validation)"
        ),
    },
    "swin_unetr_btcv_segmentation": {
        "fix": _no_img_size,
        "why": (
            "the bundle's defect: its network_def passes img_size=96, which MONAI 1.6's SwinUNETR does not take "
            "(TypeError); overridden: network_def without img_size"
        ),
    },
}


class Skip(Exception):
    """A bundle the sweep cannot prepare: the message is the row's reason."""


@dataclass
class Prepared:
    """A bundle copied to a scratch folder with synthetic data and the overrides that point it there."""

    name: str
    bundle_dir: Path
    overrides: dict[str, Any]
    config_file: Path
    notes: list[str] = field(default_factory=list)
    trainer_id: str = "train#trainer"
    evaluator_id: str | None = "validate#evaluator"
    missing: list[str] = field(default_factory=list)
    timeout: float = 0.0


@dataclass
class SweepRow:
    """One bundle's row of the sweep table."""

    bundle: str
    builds: bool = False
    trains: bool = False
    iterations: int = 0
    applied: dict[str, str] = field(default_factory=dict)
    left_alone: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    reason: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)
    speedup: float | None = None
    speedup_pairs: list[dict[str, Any]] = field(default_factory=list)
    speedup_epochs: int = 0
    speedup_validated: bool = False
    speedup_reason: str = ""
    speedup_plan_epochs: int | None = None
    speedup_medians: dict[str, Any] = field(default_factory=dict)


def _train_config(bundle: Path) -> Path | None:
    for name in TRAIN_NAMES:
        if (bundle / "configs" / name).is_file():
            return bundle / "configs" / name
    return None


def find_bundles(zoo: Path, names: Sequence[str] | None = None) -> list[Path]:
    """The bundles under ``zoo/models`` whose train config builds a ``SupervisedTrainer`` (or the ones named)."""
    models = zoo / "models"
    if not models.is_dir():
        raise SystemExit(f"bundle_sweep: {models} is not a folder (--zoo names a Model Zoo checkout)")
    found = []
    for bundle in sorted(p for p in models.iterdir() if p.is_dir()):
        if names and bundle.name not in names:
            continue
        cfg = _train_config(bundle)
        if cfg is not None and "SupervisedTrainer" in cfg.read_text(errors="replace"):
            found.append(bundle)
    missing = sorted(set(names or ()) - {b.name for b in found})
    if missing:
        raise SystemExit(f"bundle_sweep: no SupervisedTrainer bundle named {', '.join(missing)} under {models}")
    return found


def _walk(node: Any, path: str = "") -> Iterable[tuple[str, Any]]:
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}#{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}#{i}" if path else str(i))


def _get(config: dict, cid: str) -> Any:
    node: Any = config
    for part in cid.split("#"):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _ref(value: Any) -> str | None:
    """The id a plain ``@id`` reference points to."""
    if isinstance(value, str) and re.fullmatch(r"@[\w#]+", value):
        return value[1:]
    return None


def _resolve_id(config: dict, cid: str) -> str:
    """Follow plain ``@id`` references from ``cid`` to the id holding the object."""
    for _ in range(8):
        target = _ref(_get(config, cid))
        if target is None:
            return cid
        cid = target
    return cid


def _data_id(config: dict, engine_id: str, loader_key: str) -> str | None:
    """The config id of the ``data`` of the data set behind an engine's loader."""
    try:
        loader = _resolve_id(config, f"{engine_id}#{loader_key}")
        dataset = _resolve_id(config, f"{loader}#dataset")
        node = _get(config, dataset)
    except (KeyError, IndexError, ValueError, TypeError):
        return None
    return f"{dataset}#data" if isinstance(node, dict) and "data" in node else None


def _describe(config: dict, trainer_id: str) -> str:
    """What the trainer's loader is, for a reason text: its id and its target or expression."""
    try:
        loader = _resolve_id(config, f"{trainer_id}#train_data_loader")
        node = _get(config, loader)
    except (KeyError, IndexError, ValueError, TypeError):
        return "no loader found"
    if isinstance(node, dict):
        ds = node.get("dataset")
        ds_node = _get(config, _ref(ds)) if _ref(ds) else ds
        what = ds_node.get("_target_") if isinstance(ds_node, dict) else str(ds_node)[:80]
        return f"{loader}: {node.get('_target_')} over {what}"
    return f"{loader}: {str(node)[:80]}"


def _literal(config: dict, value: Any) -> Any:
    """A config value with plain ``@id`` references followed (``$`` expressions are left as they are)."""
    for _ in range(8):
        target = _ref(value)
        if target is None:
            return value
        try:
            value = _get(config, target)
        except (KeyError, IndexError, ValueError):
            return value
    return value


def _engine_id(config: dict, target: str, default: str) -> str | None:
    """The config id of the object built from ``target`` (the Model Zoo's id first)."""
    try:
        node = _get(config, default)
        if isinstance(node, dict) and str(node.get("_target_", "")).endswith(target):
            return default
    except (KeyError, IndexError, ValueError, TypeError):
        pass
    for cid, node in _walk(config):
        if isinstance(node, dict) and str(node.get("_target_", "")).split(".")[-1] == target:
            return cid
    return None


def _common_key(key: Any) -> Any:
    """``$monai.utils.CommonKeys.IMAGE`` as the key it names (``image``)."""
    m = re.fullmatch(r"\$monai\.utils\.CommonKeys\.(\w+)", key) if isinstance(key, str) else None
    return m.group(1).lower() if m else key


def _load_keys(config: dict, section: str) -> list[str]:
    for _, node in _walk(config.get(section, config)):
        if isinstance(node, dict) and node.get("_target_") in LOADERS:
            keys = _literal(config, node.get("keys", "image"))
            keys = [keys] if isinstance(keys, str) else [_literal(config, k) for k in keys]
            keys = [_common_key(k) for k in keys]
            if all(isinstance(k, str) and not k.startswith("$") for k in keys):
                return keys
    return []


def _pixdim(config: dict, dims: int) -> list[float]:
    for _, node in _walk(config.get("train", config)):
        if isinstance(node, dict) and node.get("_target_") == "Spacingd":
            pix = _literal(config, node.get("pixdim"))
            if isinstance(pix, (list, tuple)) and all(isinstance(x, (int, float)) for x in pix):
                return [float(x) for x in pix][:dims]
    return [1.0] * dims


def _io(meta: dict) -> tuple[dict, dict]:
    fmt = meta.get("network_data_format", {})
    inputs = fmt.get("inputs", {})
    outputs = fmt.get("outputs", {})
    return (next(iter(inputs.values()), {}), next(iter(outputs.values()), {}))


def _write_image(path: Path, array: np.ndarray, spacing: Sequence[float], ext: str) -> None:
    """One synthetic file: ``array`` is channel-last for NIfTI and 2-D images."""
    if ext == ".nii.gz":
        import nibabel as nib

        affine = np.diag([*spacing, 1.0]) if len(spacing) == 3 else np.eye(4)
        nib.save(nib.Nifti1Image(array, affine), str(path))
    elif ext == ".npy":
        np.save(path, array)
    else:
        from PIL import Image

        a = array.squeeze(-1) if array.ndim == 3 and array.shape[-1] == 1 else array
        Image.fromarray(a.astype(np.uint8)).save(path)


def _case(rng: np.random.Generator, shape: Sequence[int], channels: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """An image with a bright blob over noise and its label: the blob's octants carry the classes 1..C-1."""
    grid = np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij")
    radius = np.sqrt(sum(g**2 for g in grid))
    blob = radius < 0.6
    label = np.zeros(shape, np.uint8)
    if classes > 1:
        part = sum((g > 0).astype(int) << i for i, g in enumerate(grid[:3]))
        label[blob] = 1 + (part[blob] % (classes - 1))
    image = rng.normal(0, 30, (*shape, channels)) + 120 * blob[..., None]
    return image.astype(np.float32), label


def prepare(
    bundle: Path,
    work: Path,
    seed: int = 0,
    volume: Sequence[int] | None = None,
    extra: dict[str, Any] | None = None,
    cases: tuple[int, int] = (4, 1),
) -> Prepared:
    """Copy ``bundle`` into ``work`` and write synthetic data shaped like its inputs; the overrides pointing to it.

    Args:
        bundle: the bundle folder.
        work: the scratch folder the copy goes to.
        seed: the synthetic data's seed.
        volume: the synthetic images' spatial shape (default: the metadata's input shape, or :data:`CPU_SIZES`).
        extra: more overrides, applied last (sizes for a quick run).
        cases: synthetic cases for training and for validation (a bundle's own split, for example the spleen
            bundle's 32 and 9, gives its epochs their published length).

    Raises:
        Skip: the bundle reads its data in a way the sweep cannot shape, named.
    """
    from monai.bundle import ConfigParser

    name = bundle.name
    dst = work / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(bundle, dst, ignore=shutil.ignore_patterns("models", "eval", "*.pt", "*.ts"))
    cfg_file = _train_config(dst)
    assert cfg_file is not None
    config = ConfigParser.load_config_file(str(cfg_file))
    meta_path = dst / "configs" / "metadata.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    inp, out = _io(meta)
    text = cfg_file.read_text(errors="replace")
    missing = _missing_packages(meta)
    try:
        return _prepare(name, dst, cfg_file, config, inp, out, text, seed, volume, extra, missing, cases)
    except Skip as why:
        raise Skip(f"{why}{_missing_text(missing)}") from None


def _missing_packages(meta: dict) -> list[str]:
    """The optional packages the bundle's metadata lists that cannot be imported here."""
    import importlib.util

    names = {
        "pytorch-ignite": "ignite",
        "pillow": "PIL",
        "scikit-image": "skimage",
        "opencv-python": "cv2",
        "openslide-python": "openslide",
        "pyyaml": "yaml",
        "itk": "itk",
        "cucim": "cucim",
        "scikit-learn": "sklearn",
    }
    out = []
    for pkg in meta.get("optional_packages_version") or {}:
        base = re.sub(r"-cu\d+$", "", pkg.lower())
        module = names.get(base, base.replace("-", "_"))
        if importlib.util.find_spec(module) is None:
            out.append(pkg)
    return out


def _missing_text(missing: Sequence[str]) -> str:
    return f" (the metadata lists packages not installed here: {', '.join(missing)})" if missing else ""


def _prepare(
    name: str,
    dst: Path,
    cfg_file: Path,
    config: dict,
    inp: dict,
    out: dict,
    text: str,
    seed: int,
    volume: Sequence[int] | None,
    extra: dict[str, Any] | None,
    missing: list[str],
    cases: tuple[int, int] = (4, 1),
) -> Prepared:
    trainer_id = _engine_id(config, "SupervisedTrainer", "train#trainer")
    evaluator_id = _engine_id(config, "SupervisedEvaluator", "validate#evaluator")
    if trainer_id is None:
        raise Skip("no SupervisedTrainer object in the config")
    train_data = _data_id(config, trainer_id, "train_data_loader")
    if train_data is None:
        raise Skip(
            f"the data set behind {trainer_id}#train_data_loader has no 'data' list to point at synthetic "
            f"files ({_describe(config, trainer_id)})"
        )
    val_data = _data_id(config, evaluator_id, "val_data_loader") if evaluator_id else None
    keys = _load_keys(config, trainer_id.split("#")[0] if "#" in trainer_id else "")
    if not keys:
        raise Skip("no LoadImaged in the training chain: the data format is the bundle's own")
    meta_shape = list(inp.get("spatial_shape") or [])
    shape = [int(s) for s in meta_shape if isinstance(s, int) or str(s).isdigit()]
    net = config.get("network_def") if isinstance(config.get("network_def"), dict) else {}
    dims = _literal(config, net.get("spatial_dims", len(meta_shape) or 3))
    dims = int(dims) if isinstance(dims, int) else len(meta_shape) or 3
    if len(shape) != dims:
        shape = [96] * 3 if dims == 3 else [128, 128]
    size = CPU_SIZES.get(name, {})
    shape = list(volume or size.get("volume", shape))
    shape = [min(s, 128) if dims == 3 else s for s in shape]
    channels = int(inp.get("num_channels", 1) or 1)
    classes = int(out.get("num_channels", 2) or 2)
    if dims == 3 or ".nii" in text:
        ext = ".nii.gz"
    elif ".npy" in text:
        ext = ".npy"
    elif re.search(r"\.jpe?g\b", text):
        ext = ".jpg"
    else:
        ext = ".png"
    if ext in (".png", ".jpg") and channels not in (1, 3):
        raise Skip(f"{channels}-channel 2-D images have no PNG/JPEG form")
    spacing = _pixdim(config, dims) if dims == 3 else [1.0] * dims
    data_dir = dst / "synthetic_data"
    data_dir.mkdir()
    rng = np.random.default_rng(seed)
    classify = (
        out.get("type") == "probabilities"
        or out.get("format") == "classes"
        or len(out.get("spatial_shape") or []) < dims
    )
    label_keys = {key for k, key in enumerate(keys) if k > 0 and ("label" in key or "seg" in key or len(keys) == 2)}
    image_keys = [key for key in keys if key not in label_keys]
    if len(image_keys) > 1 and channels % len(image_keys) == 0:
        channels //= len(image_keys)  # one input channel per image key, concatenated by the chain
    items = []
    for i in range(sum(cases)):
        image, label = _case(rng, shape, channels, classes)
        item: dict[str, Any] = {}
        for key in keys:
            path = data_dir / f"case{i}_{key}{ext}"
            is_label = key in label_keys
            if is_label:
                arr = label[..., None] if ext != ".nii.gz" else label
                if ext in (".png", ".jpg") and classes == 2:
                    arr = arr * 255
            else:
                arr = image if ext != ".png" and ext != ".jpg" else np.clip(image, 0, 255)
                if ext == ".nii.gz" and channels == 1:
                    arr = arr[..., 0]
                if ext == ".npy":
                    arr = np.clip(image, 0, 255).astype(np.uint8)
            if ext == ".nii.gz" and arr.ndim == 4 and not is_label:
                # a multi-channel volume is one file per channel, as the Model Zoo's data lists give it
                paths = [data_dir / f"case{i}_{key}_c{c}{ext}" for c in range(arr.shape[-1])]
                for c, one in enumerate(paths):
                    _write_image(one, np.ascontiguousarray(arr[..., c]), spacing, ext)
                item[key] = [str(x) for x in paths]
                continue
            _write_image(path, arr, spacing, ext)
            item[key] = str(path)
        if classify and "label" not in item:
            item["label"] = int(i % max(classes, 1)) if classes > 1 else 0
        items.append(item)
    train_items, val_items = items[: cases[0]], items[cases[0] :]
    overrides: dict[str, Any] = {train_data: train_items, f"{trainer_id}#max_epochs": 1}
    overrides[f"{trainer_id}#epoch_length"] = 2
    if val_data is not None:
        overrides[val_data] = val_items
    if "device" in config:
        overrides["device"] = "$torch.device('cpu')"
    else:
        overrides[f"{trainer_id}#device"] = "$torch.device('cpu')"
    try:
        loader = _resolve_id(config, f"{trainer_id}#train_data_loader")
        batch = _literal(config, _get(config, loader).get("batch_size", 1))
        if isinstance(batch, int) and batch > 2:
            overrides[f"{loader}#batch_size"] = 2
    except (KeyError, AttributeError, ValueError):
        pass
    overrides.update(size.get("set", {}))
    notes = [size["why"]] if size else []
    fix = BUNDLE_FIXES.get(name)
    if fix:
        overrides.update(fix["fix"](config))
        notes.append(fix["why"])
    overrides.update(extra or {})
    return Prepared(
        name=name,
        bundle_dir=dst,
        overrides=overrides,
        config_file=cfg_file,
        notes=notes,
        trainer_id=trainer_id,
        evaluator_id=evaluator_id,
        missing=missing,
        timeout=float(size.get("timeout", 0)),
    )


def _reason(text: str) -> str:
    """The root cause of a failed run: a missing package, else the first exception of the chain, else the last line."""
    m = re.search(r"No module named '([\w.]+)'", text)
    if m:
        return f"needs package {m.group(1).split('.')[0]} (not installed here)"
    m = re.search(r"required package `([\w.]+)` is not installed", text)
    if m:
        return f"needs package {m.group(1)} (not installed here)"
    m = re.search(r"Cannot locate class or function path: '([\w.]+)'", text)
    if m:
        return f"cannot locate {m.group(1)}: needs package {m.group(1).split('.')[0]} (not installed here)"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [
        ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b.*:", ln) or ln.startswith("monai-fast bundle")
    ]
    if errors:
        first, last = errors[0], errors[-1]
        return first[:200] if first == last or len(errors) == 1 else f"{first[:200]} (then {last[:120]})"
    return lines[-1][:240] if lines else "no output"


def run_prepared(prep: Prepared, timeout: float, fast: bool = True) -> SweepRow:
    """Run one prepared bundle through ``monai-fast bundle run`` in its own process group, within ``timeout``.

    ``timeout`` is raised to the bundle's own (:data:`CPU_SIZES`) where that is longer.
    """
    from monai_fast.telemetry.record import load_record

    timeout = max(timeout, prep.timeout)

    run_dir = prep.bundle_dir / f"sweep_record-{'fast' if fast else 'published'}-{time.monotonic_ns()}"  # one per run
    cmd = [
        sys.executable,
        "-m",
        "monai_fast",
        "bundle",
        "run",
        str(prep.bundle_dir),
        "--no-logging-file",
        "--run-dir",
        str(run_dir),
        "--trainer-id",
        prep.trainer_id,
    ]
    if prep.evaluator_id:
        cmd += ["--evaluator-id", prep.evaluator_id]
    if not fast:
        cmd.append("--no-fast")
    cmd += [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in prep.overrides.items()]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "MONAI_FAST_NO_DOWNLOAD": "1",
    }
    row = SweepRow(bundle=prep.name, overrides={k: v for k, v in prep.overrides.items() if not k.endswith("#data")})
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=prep.bundle_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    row.seconds = round(time.monotonic() - start, 1)
    row.builds = any(ln.startswith("FastTraining") for ln in output.splitlines())
    try:
        rows, summary = load_record(run_dir)
    except (FileNotFoundError, ValueError):
        rows, summary = [], {}
    row.iterations = sum(1 for r in rows if r.get("kind") == "iteration" and r.get("engine") == "train")
    row.trains = row.iterations >= 2
    decisions = summary.get("fast_training") or {
        r["lever"]: r for r in rows if r.get("source") == "fast_training" and r.get("kind") == "event" and "lever" in r
    }
    for lever, d in decisions.items():
        target = row.applied if d.get("applied") else row.left_alone
        target[lever] = str(d.get("setting") if d.get("applied") else d.get("reason", ""))[:160]
    if timed_out:
        row.reason = f"over the {timeout:.0f} s limit" + ("" if row.trains else " before two iterations")
    elif proc.returncode != 0:
        row.reason = ("trained, then " if row.trains else "") + _reason(output)
        if "needs package" not in row.reason:
            row.reason += _missing_text(prep.missing)
    elif not row.trains:
        row.reason = f"ran {row.iterations} training iteration(s)"
    if prep.notes:
        row.reason = "; ".join([*prep.notes, row.reason] if row.reason else prep.notes)
    (prep.bundle_dir / "sweep_output.txt").write_text(output)
    return row


def _bundle_bench() -> Any:
    """``benchmarks/bundle.py`` as a module (its runs, epoch times and pairing are the ones used here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bundle_bench", Path(__file__).with_name("bundle.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_speedup(
    prep: Prepared,
    row: SweepRow,
    epochs: int,
    repeats: int,
    timeout: float,
    plan: bool = False,
    variants: Sequence[str] = ("published", "fast"),
) -> None:
    """The per-epoch speed-up of a bundle that trains: published and fast runs taking turns, into ``row``.

    Each run is ``benchmarks/bundle.py``'s: its own process on its own copy of the prepared bundle, the sweep's
    overrides (the epoch length left to the data) and ``epochs`` epochs. The per-epoch time is training and
    validation from the run record, the first epoch excluded; the ratio is published over fast, pair by pair, and
    ``row.speedup`` their median. A failed run leaves ``row.speedup`` None and says why in ``row.speedup_reason``.
    With ``plan``, the runs keep the bundle's own ``max_epochs`` and stop after ``epochs`` (``bundle.py --plan``);
    ``variants`` are ``bundle.py``'s, published first, and ``row.speedup_medians`` holds each one's medians.
    """
    bench = _bundle_bench()
    overrides = {k: v for k, v in prep.overrides.items() if not k.endswith("#epoch_length")}
    if plan:
        overrides.pop(f"{prep.trainer_id}#max_epochs", None)
        stop, row.speedup_plan_epochs = bench.stop_after_overrides(
            prep.bundle_dir, prep.config_file, prep.trainer_id, epochs, overrides
        )
        overrides.update(stop)
    else:
        overrides[f"{prep.trainer_id}#max_epochs"] = epochs
    args = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides.items()]
    per_run = max(timeout, prep.timeout) * max(epochs, 1)
    work = prep.bundle_dir.parent / f"{prep.name}-speedup"
    work.mkdir(exist_ok=True)
    runs = []
    row.speedup_epochs = epochs
    try:
        for repeat in range(repeats):
            for variant in variants:
                doc = bench.run_variant(prep.bundle_dir, variant, args, None, work, per_run, prep.trainer_id)
                runs.append(doc)
                print(
                    f"  {prep.name} repeat {repeat + 1} {variant}: {doc['wall_s']:.1f} s, per epoch "
                    f"{bench._per_epoch(doc['epochs'])} s",
                    flush=True,
                )
    except SystemExit as err:
        text = str(err)
        row.speedup_reason = f"{len(runs)} of {len(variants) * repeats} runs done; " + (
            text.splitlines()[0] if "limit" in text else _reason(text)
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = bench.summarise(runs, variants)
    row.speedup_pairs = summary["pairs"]
    row.speedup_medians = {k: v for k, v in summary.items() if k.startswith("median_")}
    row.speedup = summary["median_ratio"] if not row.speedup_reason else None
    row.speedup_validated = any(e["validation_s"] > 0 for run in runs for e in run["epochs"])
    if row.speedup is None and not row.speedup_reason:
        row.speedup_reason = "no epoch times in the run records"


def sweep(
    zoo: Path,
    names: Sequence[str] | None,
    timeout: float,
    work: Path,
    fast: bool = True,
    volume: Sequence[int] | None = None,
    extra: dict[str, Any] | None = None,
    speedup_epochs: int = 0,
    repeats: int = 2,
    plan: bool = False,
    variants: Sequence[str] = ("published", "fast"),
    cases: tuple[int, int] = (4, 1),
) -> list[SweepRow]:
    """Prepare and run each bundle in turn; a bundle that cannot be prepared is a row with the reason.

    With ``speedup_epochs``, each bundle that trains is then measured by :func:`measure_speedup`.
    """
    rows = []
    for bundle in find_bundles(zoo, names):
        try:
            prep = prepare(bundle, work, volume=volume, extra=extra, cases=cases)
        except Skip as why:
            rows.append(SweepRow(bundle=bundle.name, reason=str(why)))
        except Exception as err:  # noqa: BLE001 - a config the sweep cannot read is a row, not the end
            rows.append(SweepRow(bundle=bundle.name, reason=f"preparing synthetic data: {type(err).__name__}: {err}"))
        else:
            rows.append(run_prepared(prep, timeout, fast=fast))
            if speedup_epochs and rows[-1].trains:
                measure_speedup(prep, rows[-1], speedup_epochs, repeats, timeout, plan=plan, variants=variants)
        r = rows[-1]
        print(
            f"{r.bundle}: builds={r.builds} trains={r.trains} ({r.iterations} it, {r.seconds} s) "
            f"speed-up={r.speedup} {r.reason} {r.speedup_reason}".rstrip(),
            flush=True,
        )
    return rows


def _levers(applied: dict[str, str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in applied.items()) or "-"


def _speedup(r: SweepRow) -> str:
    """The per-epoch speed-up cell: the median ratio and each pair's, or ``-`` where not measured."""
    if r.speedup is None:
        return "-"
    pairs = ", ".join(f"{p['ratio']:.2f}" for p in r.speedup_pairs if p.get("ratio") is not None)
    what = "" if r.speedup_validated else ", training only"
    return f"{r.speedup:.2f}x ({pairs}; {r.speedup_epochs} epochs{what})"


def _metrics(r: SweepRow) -> str:
    """The final validation metric cell of the speed-up runs: published / fast, pair by pair, or ``-``."""
    shown = [
        f"{p['published_metric']:.3f} / {p['fast_metric']:.3f}"
        for p in r.speedup_pairs
        if p.get("published_metric") is not None and p.get("fast_metric") is not None
    ]
    return ", ".join(shown) or "-"


def table(rows: Sequence[SweepRow]) -> str:
    """The sweep as a markdown table."""
    out = [
        "| bundle | builds | trains 2 iterations | levers applied | per-epoch speed-up | final metric published / fast "
        "| why not, where not |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        why = "; ".join(x for x in (r.reason, r.speedup_reason and f"speed-up: {r.speedup_reason}") if x)
        out.append(
            f"| {r.bundle} | {'yes' if r.builds else 'no'} | {'yes' if r.trains else 'no'} | "
            f"{_levers(r.applied)} | {_speedup(r)} | {_metrics(r)} | {why.replace('|', '/') or '-'} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", required=True, type=Path, help="a folder with models/<bundle>/configs/train.json|yaml")
    ap.add_argument("--bundles", nargs="*", default=None, help="only these bundles (folder names under models/)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per bundle (default %(default)s)")
    ap.add_argument("--no-fast", action="store_true", help="run the bundles as published (no FastTraining)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="where the JSON goes")
    ap.add_argument("--keep", default=None, help="keep the prepared bundles in this folder (default: a temp folder)")
    ap.add_argument(
        "--volume",
        type=int,
        nargs="+",
        default=None,
        help="the synthetic images' spatial shape for every bundle (default: each bundle's own)",
    )
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="ID=VALUE",
        help="more overrides for every bundle (e.g. sizes for a quick run)",
    )
    ap.add_argument(
        "--speedup-epochs",
        type=int,
        default=0,
        metavar="E",
        help="measure each bundle that trains: published and fast runs of E epochs taking turns (default: not)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="rounds of runs for --speedup-epochs (default %(default)s)")
    ap.add_argument(
        "--cases",
        type=int,
        nargs=2,
        default=[4, 1],
        metavar=("TRAIN", "VAL"),
        help="synthetic cases for training and validation (default %(default)s; the spleen bundle's split: 32 9)",
    )
    ap.add_argument(
        "--plan",
        action="store_true",
        help="--speedup-epochs runs keep each bundle's own max_epochs and stop after E (benchmarks/bundle.py --plan)",
    )
    ap.add_argument(
        "--variants",
        default="published,fast",
        help="--speedup-epochs variants, published first (benchmarks/bundle.py --variants; default %(default)s)",
    )
    ap.add_argument("--zoo-commit", default=None, help="the Model Zoo commit, where --zoo is not a git checkout")
    args = ap.parse_args(argv)
    if args.speedup_epochs and (args.speedup_epochs < 2 or args.repeats < 1):
        raise SystemExit("bundle_sweep: --speedup-epochs needs at least 2 (the first is left out), --repeats 1")
    if min(args.cases) < 1:
        raise SystemExit(f"bundle_sweep: --cases {args.cases[0]} {args.cases[1]}: at least 1 each")
    from monai_fast.bundle import parse_overrides

    variants = _bundle_bench().check_variants(args.variants)
    extra = parse_overrides(args.set)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bundle-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows = sweep(
            args.zoo,
            args.bundles,
            args.timeout,
            work,
            fast=not args.no_fast,
            volume=args.volume,
            extra=extra,
            speedup_epochs=args.speedup_epochs,
            repeats=args.repeats,
            plan=args.plan,
            cases=tuple(args.cases),
            variants=variants,
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    zoo_commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=args.zoo, capture_output=True, text=True
    ).stdout.strip()
    zoo_commit = args.zoo_commit or zoo_commit
    doc = {
        "benchmark": "bundle_sweep",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "zoo": str(args.zoo),
        "zoo_commit": zoo_commit or None,
        "timeout_s": args.timeout,
        "fast": not args.no_fast,
        "speedup_epochs": args.speedup_epochs,
        "repeats": args.repeats if args.speedup_epochs else 0,
        "plan": args.plan,
        "cases": args.cases,
        "variants": variants,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "description": device_description("cpu"),
            # an ISA limit emulates a CPU without bf16 hardware on one with it: the rows depend on it
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"),
            "bf16_hardware": cpu_has_bf16_hardware(),
        },
        "rows": [asdict(r) for r in rows],
    }
    out = write_json(doc, Path(args.out) / f"bundle_sweep_{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
