"""``monai-fast launch --max-restarts`` across two nodes (two launchers on localhost meeting at a c10d rendezvous).

A rank SIGKILLed mid-epoch, or its whole node lost and a replacement launcher started with the same
command: torchrun's c10d rendezvous gathers both nodes for a new round, the tutorial resumes from
Preemption's latest periodic checkpoint at the exact data position, and the job ends on both nodes with the
weights of an uninterrupted run of the same two ranks, having redone at most the iterations since that checkpoint.
Losing the node that holds the rendezvous itself ends the job: the survivor says so, and does not hang."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from drill import kill_drill, read_progress, run_local_nodes
from tutorial_runs import tutorial_args

from monai_fast.apps.launch import free_port

SAVE_EVERY = 3  # iterations between periodic checkpoints: the most a lost rank may cost
KILL_AFTER = 5  # fp32, batch 1: 2 iterations per epoch and rank, 6 in all; killed after the first of epoch 3
ITERATIONS = 6


def _c10d(job: str) -> list[str]:
    return ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", job]


def _script(data: Path, out: Path, checkpoints: bool) -> list[str]:
    args = tutorial_args(data, out, "--progress-file", str(out / "progress"))
    return args + (["--checkpoint-dir", str(out / "ckpt"), "--save-every", str(SAVE_EVERY)] if checkpoints else [])


def _digests(out: Path) -> list[str]:
    return [json.loads((out / f"rank{r}.json").read_text())["weights_sha1"] for r in (0, 1)]


@pytest.fixture(scope="module")
def uninterrupted(two_rank_reference) -> str:
    """The weights' digest of an uninterrupted 2-rank run with these arguments (both ranks' the same)."""
    digest, other = _digests(two_rank_reference)
    assert digest == other
    return digest


def _drill(tmp_path: Path, data: Path, lose: str, c10d: list[str] | None = None):
    c10d = c10d or _c10d(f"drill-{lose}")
    out = tmp_path / "run"
    out.mkdir()
    return out, kill_drill(
        _script(data, out, checkpoints=True),
        out / "progress",
        tmp_path / "drill.log",
        KILL_AFTER,
        nproc=1,
        nodes=[c10d, c10d],
        lose=lose,
        timeout_s=300,
    )


@pytest.mark.parametrize("lose", ["rank", "node"])
def test_two_nodes_resume_after_a_lost_rank_or_node_with_the_weights_of_an_uninterrupted_run(
    tmp_path, tiny_spleen, uninterrupted, lose
):
    out, drill = _drill(tmp_path, tiny_spleen, lose)
    assert drill.returncodes == [0, 0], drill.log[-6000:]  # both nodes (a lost one: its replacement) finished
    assert drill.killed_after == KILL_AFTER and drill.steps[:KILL_AFTER] == list(range(1, KILL_AFTER + 1))
    assert sorted(set(drill.steps)) == list(range(1, ITERATIONS + 1))  # none skipped
    assert all(json.loads((out / f"rank{r}.json").read_text())["resumed_from"] == SAVE_EVERY for r in (0, 1))
    first_round = next(
        i for i in range(1, len(drill.steps) + 1) if drill.steps[i : i + 1] != [i + 1]
    )  # 1..m, then the resume
    assert first_round >= KILL_AFTER  # (the kill lands within an iteration or so of the drill's point)
    assert drill.redone == first_round - SAVE_EVERY  # exactly the iterations since the last checkpoint, no more
    assert _digests(out) == [uninterrupted, uninterrupted]  # both ranks, bit for bit


def test_losing_the_rendezvous_host_node_ends_the_other_with_a_clear_message_and_a_new_start_resumes(
    tmp_path, tiny_spleen, uninterrupted
):
    c10d = _c10d("drill-host")
    out, drill = _drill(tmp_path, tiny_spleen, "rdzv-host", c10d)
    lost, survivor = sorted(drill.returncodes)
    assert lost == -9 and survivor > 0, (
        drill.returncodes,
        drill.log[-3000:],
    )  # the survivor failed at once: no restart, no hang
    assert drill.wall_s - drill.killed_at_s < 120  # well before any gloo or rendezvous time-out
    assert f"the c10d rendezvous at {c10d[3]} is gone: its host node" in drill.log, drill.log[-6000:]
    assert "Start the launcher on every node again with the same command" in drill.log
    # what the message says: both nodes started again with the same command resume from the checkpoint
    for rc, log in run_local_nodes([c10d, c10d], _script(tiny_spleen, out, checkpoints=True), tmp_path, timeout_s=300):
        assert rc == 0, log[-3000:]
    assert all(json.loads((out / f"rank{r}.json").read_text())["resumed_from"] == SAVE_EVERY for r in (0, 1))
    assert sorted(set(read_progress(out / "progress"))) == list(range(1, ITERATIONS + 1))
    assert _digests(out) == [uninterrupted, uninterrupted]
