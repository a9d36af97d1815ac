"""The OpenMP benchmarks run end to end at toy size and write what their tables say (so they cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch  # noqa: F401  (libgomp mapped in this process, as in the benchmark's)

from monai_fast.openmp import libgomp_mapped, physical_cores

ROOT = Path(__file__).resolve().parents[1]
TOY_DEMO = [
    "--cases",
    "4",
    "--shape",
    "32",
    "32",
    "32",
    "--patch-size",
    "32",
    "32",
    "32",
    "--channels",
    "4",
    "8",
    "--max-epochs",
    "2",
    "--target",
    "0.99",
]


def _run(script: str, args: list[str], out: Path, tmp_path: Path) -> dict:
    env = {**os.environ, "MONAI_FAST_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (written,) = out.glob("*.json")
    return json.loads(written.read_text())


def test_openmp_spin_compares_spin_counts_on_equal_curves(tmp_path):
    doc = _run(
        "openmp_spin.py",
        ["--conditions", "quiet", "--repeats", "1", "--spincounts", "300000", "10000", "--", *TOY_DEMO],
        tmp_path / "out",
        tmp_path,
    )
    assert [r["spincount"] for r in doc["runs"]] == [300000, 10000]
    assert doc["curves_equal"] is True  # the spin count changes no result
    assert all(len(c) == 2 for r in doc["runs"] for c in r["curves"].values())  # both recipes, both epochs
    assert {row["spincount"] for row in doc["summary"]} == {300000, 10000}
    assert all(row["fast_s_per_epoch"] > 0 and row["per_epoch_ratio"] > 0 for row in doc["summary"])


def test_openmp_step_under_load_times_every_variant_quiet_and_loaded(tmp_path):
    doc = _run(
        "openmp_step_under_load.py", ["--repeats", "1", "--steps", "2", "--spinners", "1"], tmp_path / "out", tmp_path
    )
    seen = {(r["condition"], r["variant"]) for r in doc["runs"]}
    assert seen == {(c, v) for c in ("quiet", "loaded") for v in ("free", "bound", "workers", "iteration")}
    assert all(r["wall_s"] > 0 and r["cpu_s"] > 0 and r["threads"] >= 1 for r in doc["runs"])
    # the pinning variants did pin where it can (torch's threads on 2 or more cores), and the others did not
    can = (
        len(physical_cores()) > 1
        and all(r["threads"] == len(physical_cores()) for r in doc["runs"])
        and libgomp_mapped()
    )
    assert {r["variant"] for r in doc["runs"] if r["pinned"]} == ({"workers", "iteration"} if can else set())
