"""A stop signal during set-up (SLURM's ``SIGUSR1`` before the time limit, a spot reclaim's ``SIGTERM``).

While synthetic data are written and cached, slides checked and engines built, no trainer runs yet: a
signal then must not end the process silently (``-10``, no message). Each command or tutorial is started
as a user starts it, signalled for real once a line of its output says its set-up is under way, and
must stop before training with one line naming the signal and :data:`STOPPED_EXIT`, no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_demo_budget import TINY_DEMO

from monai_fast.handlers.preemption import STOPPED_EXIT

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path) -> dict[str, str]:
    """The repository first on the path, a fresh data cache, output unbuffered (its lines are waited for)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "MONAI_FAST_CACHE": str(tmp_path / "cache")}


def _signal_at(cmd: list[str], marker: str, sig: signal.Signals, tmp_path: Path) -> tuple[int, str]:
    """Start ``cmd``, send ``sig`` when a line of its output holds ``marker``; its exit status and whole output."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path), cwd=tmp_path
    )
    try:
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:  # the lines until set-up is under way; the rest is read by communicate()
            seen.append(line)
            if marker in line:
                break
        assert proc.poll() is None, "".join(seen)[-3000:]
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, "".join(seen) + rest


def _stopped_saying_so(rc: int, out: str, sig: signal.Signals) -> None:
    assert rc == STOPPED_EXIT, f"exit status {rc}:\n{out[-3000:]}"
    said = [line for line in out.splitlines() if f"{sig.name} received during set-up" in line]
    assert len(said) == 1 and "stopping before training" in said[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.timeout(180)
def test_the_demo_signalled_while_it_writes_its_data_stops_before_training_saying_so(tmp_path):
    sig = signal.SIGUSR1  # SLURM's warning before the time limit
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "monai_fast.apps.cli", "demo", *TINY_DEMO, "--max-epochs", "1", "--run-dir", str(run)]
    rc, out = _signal_at(cmd, "spleen-like cases to", sig, tmp_path)  # the synthetic data being written
    _stopped_saying_so(rc, out, sig)
    assert not (run / "results.json").exists()
    assert "-- fast: training to Dice" in out  # it built the recipes before stopping, all of its set-up


@pytest.mark.timeout(180)
def test_the_pathology_tutorial_signalled_while_it_builds_its_runs_stops_before_training_saying_so(tmp_path):
    sig = signal.SIGUSR1
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "tutorials" / "pathology_tumor_detection.py"),
        "--tiny",
        "--device",
        "cpu",
        "--max-epochs",
        "1",
        "--precision",
        "fp32",
        "--run-dir",
        str(run),
    ]
    rc, out = _signal_at(cmd, "validation patches from", sig, tmp_path)  # the slides written: their check is next
    _stopped_saying_so(rc, out, sig)
    assert not (run / "results.json").exists()
