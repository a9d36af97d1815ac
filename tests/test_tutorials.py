"""Every tutorial runs at tiny size, as a user would start it."""

import subprocess
import sys
from pathlib import Path

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def test_attach_to_your_trainer_tiny(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TUTORIALS / "attach_to_your_trainer.py"), "--tiny", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch ")]
    assert len(lines) == 2 and "data wait" in lines[0]
    assert "best Dice" in proc.stdout or "reached Dice" in proc.stdout


def test_profile_a_trainer_tiny(tmp_path):
    run = tmp_path / "profile"
    proc = subprocess.run(
        [
            sys.executable,
            str(TUTORIALS / "profile_a_trainer.py"),
            "--tiny",
            "--device",
            "cpu",
            "--epochs",
            "2",
            "--run-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verdict:" in proc.stdout
    for name in ("record.rank0.jsonl", "summary.rank0.json", "report.md", "trace_rank0.json", "kernels_rank0.json"):
        assert (run / name).is_file(), name
