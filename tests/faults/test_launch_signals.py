"""`monai-fast launch` under stop signals: real torchrun, two real gloo ranks, real signals.

The rank script joins a gloo group, says it is ready, and on SIGTERM / SIGUSR1 takes a second to
"checkpoint" (a marker file) and exits 0; or ignores both. The launcher must pass the signal on,
wait for the ranks, leave no process behind and exit with the job's status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

RANK_SCRIPT = """
import signal, sys, time
from pathlib import Path
import torch.distributed as dist

out, mode = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()

def checkpoint(signum, frame):
    time.sleep(1.0)
    (out / f"marker.{rank}").write_text(f"checkpoint written by rank {rank} on {signal.Signals(signum).name}")
    sys.exit(0)

for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, checkpoint if mode == "checkpoint" else signal.SIG_IGN)
dist.barrier()
(out / f"ready.{rank}").write_text("")
while True:
    time.sleep(0.1)
"""

NESTED_SCRIPT = """
import ignite.distributed as idist

def train(local_rank):
    idist.all_reduce(1.0)

if __name__ == "__main__":
    with idist.Parallel(backend="gloo", nproc_per_node=2) as parallel:
        parallel.run(train)
"""


def _launch(tmp_path: Path, *args: str) -> subprocess.Popen:
    """``monai-fast launch ARGS`` in a session of its own, its output in launch.log (no pipe that orphans hold open)."""
    with open(tmp_path / "launch.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "monai_fast.apps.cli", "launch", "--nproc", "2", *args],
            cwd=tmp_path,
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _finish(proc: subprocess.Popen, tmp_path: Path, reap: list[psutil.Process], timeout: float = 60) -> str:
    """Wait for the launcher itself to end; its output. On a hang, its processes are left to ``reap``."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        reap.extend([*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)])
        raise
    return (tmp_path / "launch.log").read_text()


def _start(tmp_path: Path, reap: list[psutil.Process], mode: str, *launch_args: str) -> tuple[subprocess.Popen, list]:
    """Start the launcher on the rank script; return it and its descendants once both ranks are ready."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    proc = _launch(tmp_path, *launch_args, str(script), str(tmp_path), mode)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
        assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the ranks never became ready"
        time.sleep(0.1)
    family = psutil.Process(proc.pid).children(recursive=True)
    reap.extend(family)
    return proc, family


@pytest.fixture
def reap():
    """Whatever the test started is killed at the end, even when the launcher left it behind."""
    started: list[psutil.Process] = []
    yield started
    for p in started:
        try:
            p.kill()
        except psutil.Error:
            pass


def _markers(tmp_path: Path) -> list[str]:
    return sorted(p.read_text() for p in tmp_path.glob("marker.*"))


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_sigterm_to_the_launcher_only_checkpoints_every_rank_and_leaves_no_orphan(tmp_path, reap):
    proc, family = _start(tmp_path, reap, "checkpoint")
    assert len(family) >= 3  # torchrun and two ranks
    os.kill(proc.pid, signal.SIGTERM)  # as docker stop, Kubernetes or `kill PID` do
    out = _finish(proc, tmp_path, reap)
    assert _markers(tmp_path) == [f"checkpoint written by rank {r} on SIGTERM" for r in (0, 1)], out[-3000:]
    assert proc.returncode == 0, out[-3000:]  # the ranks' status: both exited 0 after their checkpoint
    psutil.wait_procs(family, timeout=5)
    assert _alive(family) == []


def test_sigterm_to_the_process_group_waits_for_the_ranks_checkpoints(tmp_path, reap):
    proc, _ = _start(tmp_path, reap, "checkpoint")
    os.killpg(proc.pid, signal.SIGTERM)  # as a terminal or a batch system signals a whole group
    out = _finish(proc, tmp_path, reap)
    assert len(_markers(tmp_path)) == 2, out[-3000:]  # written before the launcher ended
    assert proc.returncode == 0, out[-3000:]


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, reap):
    proc, family = _start(tmp_path, reap, "ignore", "--grace-s", "2")
    t = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out = _finish(proc, tmp_path, reap)
    took = time.monotonic() - t
    assert took >= 2.0, out[-3000:]  # the ranks had their grace period
    assert proc.returncode != 0 and "did not stop within 2 s" in out, out[-3000:]
    psutil.wait_procs(family, timeout=5)
    assert _alive(family) == []


def test_ignite_parallel_with_nproc_per_node_under_launch_stops_with_one_clear_message(tmp_path, reap):
    script = tmp_path / "nested.py"
    script.write_text(NESTED_SCRIPT)
    proc = _launch(tmp_path, str(script))
    out = _finish(proc, tmp_path, reap, timeout=120)  # no hang, no gloo time-out
    assert proc.returncode != 0, out[-3000:]
    assert "nproc_per_node=2 was given, but this process was already started by monai-fast launch" in out, out[-3000:]
    assert "Drop nproc_per_node" in out
    assert "Gloo connectFullMesh failed" not in out
