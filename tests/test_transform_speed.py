"""``benchmarks/transform_speed.py --tiny`` times every transform of the ``fast`` chain and marks the cached head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "transform_speed.py"
HEAD = [
    "LoadImaged",
    "EnsureChannelFirstd",
    "Orientationd",
    "Spacingd",
    "ScaleIntensityRanged",
    "CropForegroundd",
    "SpatialPadd",
    "FgBgToIndicesd",
    "EnsureTyped",
]
TAIL = ["RandCropByPosNegLabeld", "RandFlipd", "RandFlipd", "RandFlipd", "RandRotate90d", "RandShiftIntensityd"]


def run_tiny(out: Path, device: str) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--device", device, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = out.glob("transform_speed_*.json")
    return done, json.loads(result.read_text())


@pytest.mark.timeout(360)
def test_tiny_run_times_each_transform_of_the_fast_chain_on_cpu_and_marks_the_cached_head(tmp_path):
    done, doc = run_tiny(tmp_path, "cpu")
    rows = doc["transforms"]
    assert [r["transform"] for r in rows] == HEAD + TAIL
    assert [r["cached"] for r in rows] == [True] * len(HEAD) + [False] * len(TAIL)
    assert doc["cached_head_length"] == len(HEAD) and doc["devices"] == ["cpu"]
    assert all(r["cpu_ms"] > 0 for r in rows)
    assert all(len(times) == 2 for times in doc["times_ms"]["cpu"])  # 2 tiny cases x 1 repeat, per transform
    s = doc["summary"]["cpu"]
    assert s["cached_ms"] == pytest.approx(sum(r["cpu_ms"] for r in rows[: len(HEAD)]))
    assert s["per_epoch_ms"] == pytest.approx(sum(r["cpu_ms"] for r in rows[len(HEAD) :]))
    assert 0 < s["cache_removes_share"] < 1
    assert "RandCropByPosNegLabeld" in done.stdout and "the cache removes" in done.stdout


@pytest.mark.gpu
@pytest.mark.timeout(360)
def test_tiny_run_on_cuda_adds_the_copy_to_the_gpu_and_times_the_chain_there(tmp_path):
    _, doc = run_tiny(tmp_path, "cuda")
    rows = doc["transforms"]
    assert [r["transform"] for r in rows] == HEAD[:1] + ["ToDeviced"] + HEAD[1:] + TAIL
    assert doc["devices"] == ["cuda"] and all(r["cuda_ms"] > 0 for r in rows)
