"""``benchmarks/ddp_scaling.py``: the "2 nodes x 1 rank" configuration (two ``monai-fast launch`` trees meeting at
127.0.0.1) times the step and the all-reduce sweep, and the ring model is fitted to what it measured."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "ddp_scaling.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("ddp_scaling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fit_link_recovers_the_latency_and_bandwidth_of_a_ring(bench):
    a, b = 30e-6, 2.5e9
    sweep = [{"bytes": n, "s": bench.ring_seconds(n, 2, a, b)} for n in (1e3, 5e5, 4e6, 1.88e7)]
    fit = bench.fit_link(sweep)
    assert fit["latency_s"] == pytest.approx(a) and fit["bandwidth_bytes_s"] == pytest.approx(b)
    assert bench.ring_seconds(1.88e7, 8, a, b) == pytest.approx(14 * a + 1.75 * 1.88e7 / b)
    with pytest.raises(ValueError, match="do not grow with the buffer"):
        bench.fit_link([{"bytes": 1e3, "s": 3e-4}, {"bytes": 1e5, "s": 2e-4}])


def test_two_launch_processes_as_nodes_time_the_step_and_the_allreduce_sweep(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--steps",
            "1",
            "--repeats",
            "1",
            "--configs",
            "nodes",
            "--sweep-mb",
            "0.001",
            "16",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = tmp_path.glob("ddp_scaling_*.json")
    doc = json.loads(result.read_text())
    (row,) = doc["rounds"]["nodes"]
    assert row["world"] == 2 and row["launcher"] == "torchrun" and row["node_ranks"] == [0, 1]  # one rank per "node"
    assert row["step_s"] > 0 and row["compute_only_step_s"] > 0 and row["allreduce_s"] > 0
    assert [p["bytes"] for p in row["sweep"]] == [1000, 16000000] and all(p["s"] > 0 for p in row["sweep"])
    fit = doc["allreduce_fit"]["nodes"]
    assert fit["bandwidth_bytes_s"] > 0 and fit["latency_s"] >= 0
    measured = [m for m in doc["model"] if m["source"] == "measured, N=2"]
    assert [m["ranks"] for m in measured] == [8, 32] and all(
        m["bandwidth_bytes_s"] == fit["bandwidth_bytes_s"] for m in measured
    )
    assert {m["link"] for m in doc["model"] if m["source"] == "assumed"} == {"NVLink", "InfiniBand 100 Gb/s"}
    assert "2 nodes x 1 rank" in done.stdout and "gloo, 2 nodes x 1 rank (loopback)" in done.stdout
