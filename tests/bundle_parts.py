"""The bundle tests' shared parts: the test bundles, their sizes for a small CPU, their data, and the two runners.

One home for what ``tests/test_bundle*.py`` and ``tests/faults/test_bundle_full_disk.py`` use alike: a
copy of a bundle of ``tests/bundles`` per test, the overrides that make each train in seconds on a
2-core CPU, the 2-D images the classification bundle reads, and a bundle run as a subprocess by
``monai-fast bundle run`` or by MONAI's own runner (``python -m monai.bundle run``) with the fragment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BUNDLES = ROOT / "tests" / "bundles"
SEG3D = BUNDLES / "seg3d"
CLASSES = ("disc", "square", "stripes")  #: the classes of `write_shapes`


def copy_bundle(name: str, into: Path) -> Path:
    """A copy of ``tests/bundles/<name>`` in ``into``, so a run writes its outputs beside nothing else's."""
    dst = into / name
    shutil.copytree(BUNDLES / name, dst)
    return dst


def small(data: Path) -> dict:
    """What a 2-core CPU needs changed in the seg3d bundle: data, epochs, device, patch and network size."""
    return {
        "dataset_dir": str(data),
        "max_epochs": 1,
        "num_val": 1,
        "patch_size": [16, 16, 16],
        "network_def#channels": [4, 8],
        "network_def#strides": [2],
        "network_def#num_res_units": 0,
        "device": "$torch.device('cpu')",
    }


def small_cls2d(data: Path) -> dict:
    """What a small CPU needs changed in the classification bundle: data, epochs, device, image and network size."""
    return {
        "dataset_dir": str(data),
        "max_epochs": 2,
        "image_size": [32, 32],
        "device": "$torch.device('cpu')",
        "network_def#init_features": 8,
        "network_def#growth_rate": 8,
        "network_def#block_config": [2, 2],
        "train#dataloader#batch_size": 4,
        "train#dataloader#num_workers": 0,
        "validate#dataloader#num_workers": 0,
    }


def write_shapes(root: Path, per_class: int = 6, size: int = 48, seed: int = 0) -> Path:
    """RGB PNG images of a disc, a square or stripes on noise, and ``datalist.json`` (the last 2 of each
    class are validation), in the Medical Decathlon's datalist form."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    lists: dict[str, list[dict]] = {"training": [], "validation": []}
    (root / "images").mkdir(parents=True)
    for label, kind in enumerate(CLASSES):
        for i in range(per_class):
            cy, cx = rng.uniform(0.35 * size, 0.65 * size, 2)
            r = rng.uniform(0.15 * size, 0.3 * size)
            if kind == "disc":
                mask = (yy - cy) ** 2 + (xx - cx) ** 2 < r * r
            elif kind == "square":
                mask = (abs(yy - cy) < r) & (abs(xx - cx) < r)
            else:
                mask = ((yy // 4) % 2 == 0) & (abs(xx - cx) < 1.5 * r)
            image = rng.normal(40, 10, (size, size, 3))
            image[mask] += rng.uniform(120, 180, 3)
            name = f"images/{kind}_{i:02d}.png"
            Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(root / name)
            lists["validation" if i >= per_class - 2 else "training"].append({"image": name, "label": label})
    (root / "datalist.json").write_text(json.dumps(lists))
    return root


def _text(value: Any) -> str:
    """An override's value as a command line writes it: text as is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def bundle_cli(bundle: Path, overrides: Mapping[str, Any], *options: str) -> subprocess.CompletedProcess:
    """``monai-fast bundle run BUNDLE [OPTIONS] id=value ...`` in its own process, from the repository root."""
    tokens = [f"{key}={_text(value)}" for key, value in overrides.items()]
    cmd = [sys.executable, "-m", "monai_fast", "bundle", "run", str(bundle), *options, *tokens]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def monai_runner(
    bundle: Path, config_files: Sequence[Path], overrides: Mapping[str, Any], *options: str
) -> subprocess.CompletedProcess:
    """MONAI's own runner on the bundle (``python -m monai.bundle run``), from the bundle folder, with its meta file,
    ``bundle_root`` set to it and ``--id value`` overrides; monai-fast importable from this checkout."""
    pairs: list[str] = []
    for key, value in {**overrides, "bundle_root": str(bundle)}.items():
        pairs += [f"--{key}", _text(value)]
    cmd = [
        sys.executable,
        "-m",
        "monai.bundle",
        "run",
        "--config_file",
        str([str(f) for f in config_files]),
        "--meta_file",
        str(bundle / "configs" / "metadata.json"),
        *options,
        *pairs,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=bundle, capture_output=True, text=True, timeout=600, env=env)
