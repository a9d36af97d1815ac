"""``monai-fast launch --max-restarts``: a rank killed with SIGKILL mid-epoch; torchrun restarts the group,
the tutorial resumes from Preemption's latest periodic checkpoint at the exact data position, and the
job ends with the weights of an uninterrupted run, having redone at most the iterations since that checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from monai_fast.distributed.drill import kill_drill, timed_launch

TUTORIAL = Path(__file__).resolve().parents[2] / "tutorials" / "distributed_train.py"
SAVE_EVERY = 3  # iterations between periodic checkpoints: the most a SIGKILL may cost


def test_a_rank_killed_mid_epoch_restarts_and_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, tiny_spleen):
    # fp32, batch 1: 2 iterations per epoch and rank, 8 in all, bit-reproducible on a CPU
    common = [str(TUTORIAL), "--tiny", "--fp32", "--batch-size", "1", "--data-dir", str(tiny_spleen), "--max-epochs", "4"]
    ref = timed_launch([*common, "--out", str(tmp_path / "ref")], tmp_path / "none", tmp_path / "ref.log")
    assert ref.returncode == 0, ref.log[-3000:]
    expected = json.loads((tmp_path / "ref" / "rank0.json").read_text())["weights_sha1"]

    out, prog = tmp_path / "out", tmp_path / "progress"
    drill = kill_drill([*common, "--out", str(out), "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", str(SAVE_EVERY),
                        "--progress-file", str(prog)], prog, tmp_path / "run.log", kill_after=SAVE_EVERY + 1)
    assert drill.returncode == 0, drill.log[-3000:]
    steps, killed_after = drill.steps, drill.killed_after  # one iteration past the checkpoint, mid-epoch
    print(f"\nSIGKILL of rank 1 after iteration {killed_after}: restarted, {drill.redone} iteration(s) redone "
          f"(checkpoint every {SAVE_EVERY}); completed iterations in order: {steps}")
    assert sorted(set(steps)) == list(range(1, 9))  # none skipped
    assert steps[: killed_after] == list(range(1, killed_after + 1))
    assert drill.redone <= SAVE_EVERY  # at most the iterations since the last checkpoint
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["resumed_from"] == r1["resumed_from"] is not None and r0["resumed_from"] % SAVE_EVERY == 0
    assert r0["weights_sha1"] == r1["weights_sha1"] == expected
