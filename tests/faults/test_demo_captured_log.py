"""``monai-fast demo > log 2>&1``: a captured log has no carriage-return redraws and no line said twice."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

TINY_DEMO = [
    "--cases",
    "4",
    "--shape",
    "32",
    "32",
    "32",
    "--patch-size",
    "32",
    "32",
    "32",
    "--channels",
    "4",
    "8",
    "--max-epochs",
    "2",
    "--target",
    "0.99",
]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "MONAI_FAST_PIN_OPENMP")
    }
    env["MONAI_FAST_CACHE"] = str(tmp_path / "cache")
    return env


def _pinning_applies(env: dict[str, str]) -> bool:
    """Whether a new process started with ``env`` has torch threads on 2 or more cores, one per core, and libgomp.

    Asked of a fresh interpreter: an earlier test in this process may have changed its thread count.
    """
    probe = (
        "import torch; from monai_fast.openmp import libgomp_mapped, physical_cores; n = len(physical_cores()); "
        "print(n > 1 and torch.get_num_threads() == n and libgomp_mapped())"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() == "True"


def _captured_demo(tmp_path: Path) -> str:
    env = _env(tmp_path)
    log = tmp_path / "log"
    with open(log, "wb") as f:  # stdout and stderr to one file, as a shell's `> log 2>&1`
        proc = subprocess.run(
            [sys.executable, "-m", "monai_fast", "demo", *TINY_DEMO, "--run-dir", str(tmp_path / "run")],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=600,
        )
    text = log.read_text()
    assert proc.returncode == 0, text
    return text


def test_captured_demo_log_has_no_redraws_and_no_line_twice(tmp_path):
    text = _captured_demo(tmp_path)
    assert "\r" not in text
    lines = [
        re.sub(r"^\d\d:\d\d:\d\d ", "", ln) for ln in text.splitlines() if ln.strip() and not set(ln) <= {"-", " "}
    ]
    twice = {ln: n for ln, n in collections.Counter(lines).items() if n > 1}
    assert not twice, twice
    # the command's entry point bounded OpenMP's spin before torch loaded, and said so once
    assert len([ln for ln in lines if "OpenMP threads spin at most 10000 rounds" in ln]) == 1, text
    # and pinned OpenMP's worker threads one per core where torch's threads cover 2 or more cores, saying so once
    pinned = [ln for ln in lines if "worker thread(s) pinned one per core" in ln]
    assert len(pinned) == (1 if _pinning_applies(_env(tmp_path)) else 0), text
    # one line per epoch instead of a bar: each recipe's two epochs, with loss and time (Dice when fully validated)
    for recipe in ("fast", "baseline"):
        assert len([ln for ln in lines if re.search(rf"{recipe} epoch \d+: loss .* s \(train", ln)]) == 2
