"""The GPU suite's ``--device cpu --tiny`` mode runs every step, so the suite cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
STEPS = [
    "pytest",
    "race",
    "overlaps",
    "your_trainer",
    "tuner_quality",
    "loader_variants",
    "inference",
    "pathology",
    "lab",
    "kernels",
    "nvtx",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tiny_cpu_suite_runs_every_step_and_writes_the_results_json(tmp_path):
    out = tmp_path / "suite"
    done = subprocess.run(
        [sys.executable, str(SUITE), "--device", "cpu", "--tiny", "--out", str(out), "--commit", "abc1234"],
        capture_output=True,
        text=True,
        timeout=840,
        cwd=ROOT,
    )
    doc = json.loads((out / "gpu_suite.json").read_text())
    assert done.returncode == 0, (
        done.stdout[-3000:] + done.stderr[-3000:] + json.dumps(doc["steps"], default=str)[-3000:]
    )
    assert doc["tiny"] is True and doc["passed"] == STEPS and doc["failed"] == []
    m = doc["machine"]
    assert m["device"] == "cpu" and m["commit"] == "abc1234" and m["commit_from"] == "--commit"
    assert {"description", "driver", "torch", "cuda", "cudnn", "packages"} <= set(m)
    assert m["packages"]["monai"] and m["packages"]["pytorch-ignite"]
    steps = doc["steps"]
    for name in STEPS:
        assert steps[name]["status"] == "passed" and steps[name]["results"] is not None, name
        assert (out / steps[name]["log"]).stat().st_size > 0, name
    assert steps["pytest"]["results"]["tests"] >= 8  # every gpu-marked test collected (skipped here)
    runs = steps["race"]["results"]["runs"]
    assert sorted(r["recipe"] for r in runs) == ["baseline", "fast", "monai_tutorial"]
    assert set(steps["race"]["results"]["bars"]) == {
        "fast_2x_monai_tutorial",
        "fast_20x_baseline",
        "fast_gpu_util_90",
        "fast_data_wait_under_2pct",
    }
    overlaps = steps["overlaps"]["results"]
    assert set(overlaps["summary"]) == {"off", "on"}  # whether the toy target is reached in 2 epochs does not matter
    assert set(overlaps["bars"]) == {"on_first_within_1_5x_training", "on_1_8x_faster_than_off", "gpu_util_not_lower"}
    assert overlaps["bars"]["gpu_util_not_lower"] is None  # no GPU: no utilisation to compare
    assert steps["your_trainer"]["results"]["median_epoch_ratio"] > 0
    assert steps["tuner_quality"]["results"]["picks"]
    assert steps["loader_variants"]["results"]["gpu_cache"] is False  # CPU: no GPU cache variant
    assert {r["backend"] for r in steps["inference"]["results"]["rows"]} >= {"eager", "tensorrt"}
    pathology = {r["variant"]: r for r in steps["pathology"]["results"]["runs"]}  # benchmarks/pathology.py --tiny
    assert set(pathology) == {"plain", "fast"} and all(r["patches_per_s"] > 0 for r in pathology.values())
    assert pathology["plain"]["reader"].startswith("tifffile (MONAI's")
    assert "cucim" in json.loads(next(out.rglob(steps["pathology"]["results"]["file"])).read_text())["machine"]
    pathology_log = (out / steps["pathology"]["log"]).read_text()
    assert "| plain | 1 |" in pathology_log and "| fast | 1 |" in pathology_log
    lab = steps["lab"]["results"]
    assert lab["epochs"] == 2 and lab["network"].startswith("SegResNet") and lab["time_per_epoch_s"] > 0
    assert (out / "lab" / "performance.md").read_text().count("| time per epoch |") == 1 and (
        out / "lab" / "prediction.png"
    ).is_file()
    assert steps["kernels"]["results"]["match"] is True
    assert steps["nvtx"]["results"]["checked"] in (True, False)
    assert not (out / "work").exists()  # the scratch data is not left in the results folder
