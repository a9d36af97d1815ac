"""``benchmarks/overlaps.py`` runs end to end at toy size and its table is what its runs measured (so it cannot rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "overlaps.py"
TOY = [
    "--cases",
    "6",
    "--shape",
    "48",
    "48",
    "32",
    "--patch",
    "32",
    "32",
    "32",
    "--channels",
    "4",
    "8",
    "--target",
    "0.05",
    "--max-epochs",
    "8",
    "--repeats",
    "1",
    "--fixed-epochs",
    "1",
    "--variants",
    "off",
    "on",
    "--device",
    "cpu",
]


@pytest.mark.slow
def test_overlaps_runs_fast_with_the_overlaps_off_and_on_and_reports_the_issues_ratios(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), *TOY],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (written,) = tmp_path.glob("overlaps_*.json")
    doc = json.loads(written.read_text())
    to_target = {r["variant"]: r for r in doc["runs"] if "first_s" in r}
    fixed = {r["variant"]: r for r in doc["runs"] if "final_dice" in r}
    assert set(to_target) == set(fixed) == {"off", "on"}
    for r in to_target.values():
        assert r["first_s"] is not None and r["first_epoch"] >= 1  # the toy target is reached
        windows = [e for e in r["epochs"] if e["epoch"] <= r["first_epoch"]]
        assert len(windows) == r["first_epoch"] and all(e["train_s"] > 0 and e["train_cpu_s"] >= 0 for e in windows)
        assert r["train_s_to_first"] == pytest.approx(sum(e["train_s"] for e in windows))
        # the clock starts before the data sets are built: set-up and the training windows are inside it
        assert r["first_s"] >= r["setup_s"] + r["train_s_to_first"] - 1e-6
        assert 0 < r["cpu_s_to_first"] <= r["cpu_s"]
    for r in fixed.values():
        assert r["epochs_run"] == 1 and 0 <= r["final_dice"] <= 1
    off, on = doc["summary"]["off"], doc["summary"]["on"]
    assert on["off_over_this_first"] == [pytest.approx(to_target["off"]["first_s"] / to_target["on"]["first_s"])]
    assert off["off_over_this_first"] == [pytest.approx(1.0)]
    ratio = to_target["on"]["first_s"] / to_target["on"]["train_s_to_first"]
    assert on["first_over_train"] == pytest.approx(ratio)
    assert on["cpu_floor_s"] == pytest.approx(to_target["on"]["cpu_s_to_first"] / doc["machine"]["cpus"])
    assert on["gpu_util_training"] is None  # a CPU run samples no GPU
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("on "))
    assert f"{ratio:.2f}x" in line and f"{on['off_over_this_first'][0]:.2f}" in line  # the printed table is the JSON's


def test_overlaps_refuses_bad_counts_before_any_work(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "--repeats and --max-epochs must be >= 1" in proc.stderr
    assert not list(tmp_path.glob("overlaps_*.json"))
