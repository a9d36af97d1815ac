"""What the docs tell a SLURM user to type must reach the training tasks (a ``B:`` signal
flag in a docstring would signal only the batch shell under ``srun``)."""

from __future__ import annotations

import re
from pathlib import Path

from monai_fast.apps.launch.jobs import SbatchSpec, render_sbatch

ROOT = Path(__file__).resolve().parents[2]


def test_no_doc_sends_the_preemption_signal_to_the_batch_shell_only():
    texts = {
        p: p.read_text()
        for p in [
            *ROOT.glob("tutorials/*.py"),
            *ROOT.glob("monai_fast/**/*.py"),
            *ROOT.glob("docs/*.md"),
            ROOT / "README.md",
        ]
    }
    offenders = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p, t in texts.items()
        for m in re.finditer(r"--signal=B:\S+[^\n]*srun", t)
    ]
    assert not offenders, offenders


def test_the_rendered_sbatch_script_signals_the_tasks():
    script = render_sbatch(SbatchSpec(command=["python", "train.py", "--checkpoint-dir", "ckpt"]))
    assert "#SBATCH --signal=USR1@" in script and "--signal=B:" not in script
