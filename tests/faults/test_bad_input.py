"""Bad input gets one clear message naming the file, key or option, before work is lost.

Real NIfTI files (a truncated gzip body keeps its header readable), the real CLI in a subprocess
for the process-level checks (exit code, no abort, the file named on stderr), and the real
preflight on files written with nibabel.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import generate_msd

SHAPE = (24, 24, 16)
AFFINE = np.diag([1.6, 1.6, 2.5, 1.0])
CLI_TIMEOUT_S = 400  # "does not hang" bound, far above a tiny one-epoch run


@pytest.fixture(scope="module")
def clean_set(tmp_path_factory) -> Path:
    return generate_msd(tmp_path_factory.mktemp("clean"), num_cases=6, shape=SHAPE, progress=False)


def _truncated_copy(clean: Path, dest: Path, side: str) -> tuple[Path, str]:
    """A copy of ``clean`` whose last ``side`` ("train"/"val") image keeps only the first half of its bytes."""
    shutil.copytree(clean, dest)
    train, val = load_msd_datalist(dest, val_fraction=0.25, seed=0)
    victim = Path((train if side == "train" else val)[-1]["image"])
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    return dest, str(victim)


def _demo(data_dir: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "monai_fast.apps.cli",
        "demo",
        "--data-dir",
        str(data_dir),
        "--device",
        "cpu",
        "--max-epochs",
        "1",
        "--patch-size",
        "16",
        "16",
        "16",
        "--channels",
        "4",
        "8",
        "--target",
        "0.99",
        "--no-progress",
        "--run-dir",
        str(run_dir),
        *extra,
    ]
    env = {**os.environ, "MONAI_FAST_CACHE": str(run_dir.parent / "cache")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env)


@pytest.mark.parametrize(
    "side,extra",
    [
        ("val", ("--recipes", "fast", "--cache", "ram")),
        ("train", ("--recipes", "fast", "--cache", "ram")),
        ("train", ("--recipes", "fast", "--cache", "none", "--workers", "1")),
        ("val", ("--recipes", "monai_tutorial")),
    ],
    ids=["val-ram", "train-ram", "train-nocache-worker", "val-monai_tutorial"],
)
def test_truncated_nifti_ends_cli_with_one_line_naming_the_file_without_abort(clean_set, tmp_path, side, extra):
    data, victim = _truncated_copy(clean_set, tmp_path / "data", side)
    done = _demo(data, tmp_path / "run", "--no-preflight", *extra)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-2000:]  # SystemExit with a message; not 134 / SIGABRT
    assert "terminate called" not in done.stderr
    assert last.startswith("monai-fast demo: bad data: ") and victim in last, last


def test_preflight_in_the_cli_names_the_truncated_file_before_training(clean_set, tmp_path):
    data, victim = _truncated_copy(clean_set, tmp_path / "data", "val")
    done = _demo(data, tmp_path / "run", "--recipes", "fast")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "preflight found 1 problem" in done.stderr and f"{victim}: cannot read the image" in done.stderr
    assert "training to Dice" not in done.stdout  # nothing trained


@pytest.mark.parametrize("cache", ["disk", "smartcache"])
def test_truncated_nifti_in_disk_and_smartcache_raises_data_item_error_naming_the_file(clean_set, tmp_path, cache):
    from monai_fast.apps.recipes import RecipeConfig, build_recipe
    from monai_fast.data.items import DataItemError

    data, victim = _truncated_copy(clean_set, tmp_path / "data", "train")
    train, val = load_msd_datalist(data, val_fraction=0.25, seed=0)
    config = RecipeConfig(
        patch_size=(16, 16, 16),
        channels=(4, 8),
        strides=(2,),
        max_epochs=1,
        cache=cache,
        cache_dir=str(tmp_path / "disk"),
        num_workers=0,
        cache_threads=1,
    )
    with pytest.raises(DataItemError, match=victim):
        build_recipe("fast", train, val, config, "cpu", progress=False).trainer.run()


# ---- preflight ----------------------------------------------------------------------------------


def _write(path: Path, array: np.ndarray) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.Nifti1Image(array, AFFINE).to_filename(str(path))
    return str(path)


def _bad_set(root: Path) -> tuple[list[dict], dict[str, str]]:
    """One good item and one item per kind of bad data; returns the files and {bad path: expected reason}."""
    rng = np.random.default_rng(0)
    image = rng.normal(size=SHAPE).astype(np.float32)
    label = (rng.random(SHAPE) > 0.7).astype(np.uint8)
    files, bad = [], {}

    def item(name, img=image, lab=label):
        files.append(
            {"image": _write(root / f"{name}_img.nii.gz", img), "label": _write(root / f"{name}_lab.nii.gz", lab)}
        )
        return files[-1]

    item("good")
    bad[item("classes", lab=label * 2)["label"]] = "outside the 2 classes"
    bad[item("fraction", lab=label * 0.5)["label"]] = "non-integer"
    flat = item("flat", img=image[:, :, 0], lab=label[:, :, 0])
    bad[flat["image"]] = bad[flat["label"]] = "not a 3D volume"
    nan = image.copy()
    nan[3, 4, 5] = np.nan
    bad[item("nan", img=nan)["image"]] = "NaN or Inf"
    bad[item("shape", lab=label[:, :, :-2])["image"]] = "spatial shape (24, 24, 16) but its label"
    cut = item("cut")["image"]
    Path(cut).write_bytes(Path(cut).read_bytes()[:200])
    bad[cut] = "cannot read the image"
    return files, bad


def test_preflight_lists_every_bad_file_with_its_reason(tmp_path):
    from monai_fast.data.preflight import PreflightError, preflight

    files, bad = _bad_set(tmp_path / "d")
    with pytest.raises(PreflightError) as err:
        preflight(files, num_classes=2, cache_path=tmp_path / "scans.json")
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"preflight found {len(bad)} problem(s)")
    for path, reason in bad.items():
        assert any(line.strip().startswith(f"{path}:") and reason in line for line in lines), (path, reason, lines)
    assert not any(files[0]["image"] in line or files[0]["label"] in line for line in lines)


def test_preflight_second_call_reads_no_file_and_rereads_a_changed_one(tmp_path, monkeypatch):
    from monai_fast.data import preflight as pf

    files, _ = _bad_set(tmp_path / "d")
    files = files[:1]  # the good item
    reads: list[str] = []
    real = pf.scan_file
    monkeypatch.setattr(pf, "scan_file", lambda p: reads.append(str(p)) or real(p))
    first = pf.preflight(files)  # default store: cache_root()/preflight.json (isolated per test)
    assert first.ok and first.read == 2 and len(reads) == 2
    second = pf.preflight(files)
    assert second.ok and second.read == 0 and second.from_cache == 2 and len(reads) == 2
    os.utime(files[0]["label"], ns=(1, 1))  # a new identity: read again, the image still from the cache
    third = pf.preflight(files)
    assert third.read == 1 and reads[-1] == files[0]["label"]


def test_race_skips_preflight_when_turned_off(tmp_path, monkeypatch):
    from monai_fast.apps.demo import RaceSpec, checked_data
    from monai_fast.data import preflight as pf

    files, _ = _bad_set(tmp_path / "d")
    calls = []
    monkeypatch.setattr(pf, "preflight", lambda *a, **k: calls.append(a))
    checked_data(RaceSpec(train_files=files[:1], val_files=files[:1], preflight=False))
    assert calls == []
    checked_data(RaceSpec(train_files=files[:1], val_files=files[:1]))
    assert len(calls) == 1


# ---- options ------------------------------------------------------------------------------------


def _cli_error(tmp_path: Path, *argv: str) -> str:
    from monai_fast.apps.cli import main

    with pytest.raises(SystemExit) as done:
        main(["demo", "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--no-progress", *argv])
    message = str(done.value.code)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_unknown_device_name_is_one_line_naming_device(tmp_path):
    assert _cli_error(tmp_path, "--device", "gpu0").startswith("monai-fast demo: --device: 'gpu0' is not a device name")


def test_single_level_channels_is_one_line_naming_channels(tmp_path):
    assert "channels must be two or more levels" in _cli_error(tmp_path, "--channels", "8")


def test_nan_intensity_window_is_rejected_naming_it():
    from monai_fast.apps.demo import OptionError, RaceSpec, plan_race
    from monai_fast.apps.recipes import RecipeConfig

    with pytest.raises(ValueError, match="intensity_window must be two finite numbers"):
        RecipeConfig(intensity_window=(math.nan, 100.0))
    with pytest.raises(OptionError, match="intensity_window"):
        plan_race(RaceSpec(device="cpu", overrides={"intensity_window": (0.0, math.nan)}), need_run_dir=False)


def test_patch_larger_than_volumes_warns_with_the_padding(clean_set, caplog):
    from monai_fast.apps.demo import RaceSpec, checked_data

    train, val = load_msd_datalist(clean_set, val_fraction=0.25, seed=0)
    # 24 x 24 x 16 voxels of 1.6 x 1.6 x 2.5 mm resampled to 1.5 x 1.5 x 2.0 mm: 26 x 26 x 20
    with caplog.at_level("WARNING", logger="monai_fast.apps.demo.core"):
        checked_data(RaceSpec(train_files=train, val_files=val, overrides={"patch_size": (32, 32, 32)}))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "padded on every load, by up to (6, 6, 12) voxels" in warnings[0], warnings


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch build or machine without CUDA")
def test_build_recipe_on_cuda_without_cuda_is_one_clear_error(clean_set):
    from monai_fast.apps.recipes import RecipeConfig, build_recipe

    train, val = load_msd_datalist(clean_set, val_fraction=0.25, seed=0)
    for name in ("fast", "baseline", "monai_tutorial"):
        with pytest.raises(ValueError, match="device 'cuda': this torch build or machine has no CUDA device"):
            build_recipe(name, train, val, RecipeConfig(patch_size=(16, 16, 16)), device="cuda", progress=False)
