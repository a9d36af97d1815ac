"""``benchmarks/ddp_tier_epoch.py`` runs end to end at toy size, with real torchrun jobs of two gloo ranks, and
writes what its table says (so it cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOY = ["--cases", "4", "--shape", "40", "40", "24", "--patch", "16", "16", "16", "--channels", "4", "8"]
TOY += ["--epochs", "2", "--repeats", "1"]


def test_ddp_tier_epoch_compares_the_shared_tier_with_a_partition_in_real_ddp_jobs(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ddp_tier_epoch.py"), "--out", str(tmp_path), *TOY],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MONAI_FAST_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    doc = json.loads(next(tmp_path.glob("ddp_tier_epoch_*.json")).read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert rows["shared"]["data"] == "disk" and rows["partition"]["data"] == "ram", doc["runs"]
    assert "DistributedSampler kept" in doc["runs"][0]["reason"]
    # over two epochs rank 0's kept sampler reaches beyond its half; a partition never does
    assert rows["partition"]["rank0_items_share"] <= 0.5 < rows["shared"]["rank0_items_share"]
    assert f"{doc['median_shared_speed_vs_partition']:.2f}x the partition's speed" in out.stdout


def test_ddp_tier_epoch_refuses_a_single_rank():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ddp_tier_epoch.py"), "--ranks", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--ranks" in out.stderr
