"""``benchmarks/compile_step.py`` runs end to end at toy size and writes what its table says (so it cannot rot)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY = ["--patch", "16", "16", "16", "--channels", "4", "8", "--batch", "2", "--steps", "2", "--repeats", "1"]


@pytest.mark.slow
@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="torch.compile on a CPU needs a C++ compiler"
)
def test_compile_step_times_eager_and_compiled_in_their_own_processes(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a cold compile, not this host's cache
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_step.py"), "--out", str(tmp_path), *TOY],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (written,) = tmp_path.glob("compile_step_*.json")
    doc = json.loads(written.read_text())
    assert [r["variant"] for r in doc["runs"]] == ["eager", "compile"]
    assert all(len(r["train_s"]) == 2 and len(r["window_s"]) == 2 and min(r["train_s"]) > 0 for r in doc["runs"])
    (row,) = doc["rows"]
    eager, compiled = doc["runs"]
    assert row["train_ratio"] == pytest.approx(
        statistics.median(eager["train_s"]) / statistics.median(compiled["train_s"])
    )
    assert compiled["train_first_s"] > max(compiled["train_s"])  # the first compiled step carries the compile
    assert f"{row['train_ratio']:.2f}x" in proc.stdout  # the printed table is the JSON's


def test_compile_step_refuses_a_bad_count():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_step.py"), "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "--steps and --repeats must be >= 1" in proc.stderr


def test_compile_step_names_the_missing_compiler_before_it_runs(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no g++, c++ or clang++ there
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_step.py"), "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "need a C++ compiler (g++ or clang++)" in proc.stderr
    assert not list(tmp_path.glob("compile_step_*.json"))
