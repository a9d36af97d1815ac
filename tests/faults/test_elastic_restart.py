"""``monai-fast launch --max-restarts``: a rank killed with SIGKILL mid-epoch; torchrun restarts the group,
the tutorial resumes from Preemption's latest periodic checkpoint at the exact data position, and the
job ends with the weights of an uninterrupted run, having redone at most the iterations since that checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

TUTORIAL = Path(__file__).resolve().parents[2] / "tutorials" / "distributed_train.py"
SAVE_EVERY = 3  # iterations between periodic checkpoints: the most a SIGKILL may cost


def _launch(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe an orphan could hold open
        return subprocess.Popen([sys.executable, "-m", "monai_fast.cli", "launch", "--nproc", "2", "--grace-s", "10", *args],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _progress(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _rank(launcher: subprocess.Popen, rank: str) -> psutil.Process:
    """The training process of ``rank`` (torchrun's child; not one of its data-loader workers)."""
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == rank and "torch.distributed.run" in " ".join(p.parent().cmdline()):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} under the launcher")


def test_a_rank_killed_mid_epoch_restarts_and_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, tiny_spleen):
    # fp32, batch 1: 2 iterations per epoch and rank, 8 in all, bit-reproducible on a CPU
    common = [str(TUTORIAL), "--tiny", "--fp32", "--batch-size", "1", "--data-dir", str(tiny_spleen), "--max-epochs", "4"]
    ref = _launch(*common, "--out", str(tmp_path / "ref"), log=tmp_path / "ref.log")
    assert ref.wait(timeout=420) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    expected = json.loads((tmp_path / "ref" / "rank0.json").read_text())["weights_sha1"]

    out, prog, log = tmp_path / "out", tmp_path / "progress", tmp_path / "run.log"
    launcher = _launch("--max-restarts", "1", *common, "--out", str(out), "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--save-every", str(SAVE_EVERY), "--progress-file", str(prog), log=log)
    try:
        deadline = time.monotonic() + 420
        while len(_progress(prog)) < SAVE_EVERY + 1:  # one iteration past the checkpoint, mid-epoch
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.01)
        killed_after = _progress(prog)[-1]
        os.kill(_rank(launcher, "1").pid, signal.SIGKILL)
        assert launcher.wait(timeout=420) == 0, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(60)
    steps = _progress(prog)
    redone = len(steps) - len(set(steps))
    print(f"\nSIGKILL of rank 1 after iteration {killed_after}: restarted, {redone} iteration(s) redone "
          f"(checkpoint every {SAVE_EVERY}); completed iterations in order: {steps}")
    assert sorted(set(steps)) == list(range(1, 9))  # none skipped
    assert steps[: killed_after] == list(range(1, killed_after + 1))
    assert redone <= SAVE_EVERY  # at most the iterations since the last checkpoint
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["resumed_from"] == r1["resumed_from"] is not None and r0["resumed_from"] % SAVE_EVERY == 0
    assert r0["weights_sha1"] == r1["weights_sha1"] == expected
