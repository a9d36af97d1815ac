"""``monai-fast launch --max-restarts``: a rank killed with SIGKILL mid-epoch; torchrun restarts the group,
the tutorial resumes from Preemption's latest periodic checkpoint at the exact data position, and the
job ends with the weights of an uninterrupted run, having redone at most the iterations since that checkpoint.

The scenario is ``benchmarks/elastic_restart.py`` at its toy size (so the benchmark cannot rot either)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "elastic_restart.py"
SAVE_EVERY = 3  # iterations between periodic checkpoints: the most a SIGKILL may cost


def _benchmark(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARK), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_a_rank_killed_mid_epoch_restarts_and_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    # fp32, batch 1: 2 iterations per epoch and rank, 8 in all, bit-reproducible on a CPU; rank 1 is killed
    # after iteration 5 (the first of epoch 3), 2 past the checkpoint at iteration 3 (the first of epoch 2)
    done = _benchmark("--tiny", "--save-every", str(SAVE_EVERY), "--epochs", "4", "--out", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout)
    (result,) = tmp_path.glob("elastic_restart_*.json")
    doc = json.loads(result.read_text())
    assert doc["uninterrupted"]["steps"] == list(range(1, 9))
    (row,) = doc["rows"]
    steps, killed_after = row["steps"], row["killed_after"]
    # the SIGKILL follows the progress file's 5th iteration; on a busy machine the rank may end one more first
    assert killed_after in (2 * SAVE_EVERY - 1, 2 * SAVE_EVERY), killed_after
    checkpoint = killed_after // SAVE_EVERY * SAVE_EVERY  # the newest periodic checkpoint before the kill
    assert steps[:killed_after] == list(range(1, killed_after + 1))
    assert sorted(set(steps)) == list(range(1, 9))  # none skipped
    assert row["resumed_from"] == checkpoint  # the periodic checkpoint (mid-epoch at iteration 3)
    assert row["iterations_redone"] <= SAVE_EVERY  # at most the iterations since the last checkpoint
    assert row["weights_equal"] is True  # both ranks, bit for bit
    assert row["restart_s"] > 0 and row["wall_s"] > 0
    assert (
        f"{SAVE_EVERY:>10} {killed_after:>12} {checkpoint:>10} {row['iterations_redone']:>6} {row['restart_s']:>9.1f}"
        in done.stdout
    )


def test_elastic_restart_benchmark_names_a_bad_save_every_before_running(tmp_path):
    done = _benchmark("--tiny", "--save-every", "0", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 2 and "--save-every [0]" in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())
