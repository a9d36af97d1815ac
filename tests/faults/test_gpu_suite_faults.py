"""The GPU suite records a failed step and goes on, ends a step that overruns, and refuses a device it lacks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
SUITE = ROOT / "benchmarks" / "gpu_suite.py"


@pytest.mark.timeout(300)
def test_a_step_over_its_time_limit_is_ended_recorded_as_failed_and_the_suite_goes_on(tmp_path):
    out = tmp_path / "suite"
    t0 = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            str(SUITE),
            "--device",
            "cpu",
            "--tiny",
            "--out",
            str(out),
            "--steps",
            "race",
            "kernels",
            "--step-timeout",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert time.monotonic() - t0 < 200  # each step was ended at its limit, not waited for
    assert done.returncode == 1, done.stderr[-2000:]
    doc = json.loads((out / "gpu_suite.json").read_text())
    assert doc["failed"] == ["race", "kernels"] and doc["passed"] == []  # the second step ran after the first failed
    for name in ("race", "kernels"):
        step = doc["steps"][name]
        assert step["status"] == "failed" and "timed out after 2 s" in step["error"], step
        assert "log_tail" in step and (out / step["log"]).is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_on_a_machine_without_it_is_refused_naming_the_option(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SUITE), "--device", "cuda", "--out", str(tmp_path / "suite")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--device 'cuda'" in done.stderr and "no CUDA device" in done.stderr
    assert not (tmp_path / "suite").exists()  # nothing started
