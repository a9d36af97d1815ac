"""The ``monai-fast`` entry point bounds GNU OpenMP's spin before torch loads; the user's choice wins; results unchanged.

libgomp itself is asked what it read (``OMP_DISPLAY_ENV=VERBOSE`` makes it print its settings when it
loads), so these tests check the setting that took effect, not only the environment.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from monai_fast.openmp import BOUNDED_SPINCOUNT, bound_openmp_spin, openmp_loaded


def _libgomp_spincount(args: list[str], **extra: str) -> str:
    """Run ``python args`` in a fresh process and return the GOMP_SPINCOUNT libgomp displayed when it loaded."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(OMP_DISPLAY_ENV="VERBOSE", **extra)
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", proc.stderr + proc.stdout)
    if found is None:
        pytest.skip("this torch does not run on GNU OpenMP (libgomp printed no settings)")
    return found.group(1)


def test_the_command_bounds_the_spin_libgomp_reads():
    assert _libgomp_spincount(["-m", "monai_fast", "--help"]) == str(BOUNDED_SPINCOUNT)
    # without the entry point libgomp keeps its own default: the bound is what changed it
    assert _libgomp_spincount(["-c", "import torch"]) != str(BOUNDED_SPINCOUNT)


@pytest.mark.parametrize("extra, expected", [({"GOMP_SPINCOUNT": "77"}, "77"), ({"OMP_WAIT_POLICY": "ACTIVE"}, None)])
def test_a_spin_count_or_wait_policy_the_user_set_is_left_alone(extra, expected):
    shown = _libgomp_spincount(["-m", "monai_fast", "--help"], **extra)
    if expected is None:
        assert shown != str(BOUNDED_SPINCOUNT)
    else:
        assert shown == expected


def test_nothing_is_set_once_libgomp_has_loaded():
    assert openmp_loaded()  # torch is imported in this test process
    env: dict[str, str] = {}
    assert bound_openmp_spin(env) is None and env == {}
    assert bound_openmp_spin(env, loaded=False) is not None and env == {"GOMP_SPINCOUNT": str(BOUNDED_SPINCOUNT)}


_STEPS = """
import torch
from monai.networks.nets import UNet
torch.set_num_threads(2)
torch.manual_seed(0)
net = UNet(3, 1, 2, (8, 16, 32), (2, 2), num_res_units=1)
opt = torch.optim.AdamW(net.parameters(), 1e-2)
x = torch.randn(2, 1, 32, 32, 32)
for _ in range(3):
    opt.zero_grad()
    net(x).square().mean().backward()
    opt.step()
torch.save(torch.cat([p.detach().flatten() for p in net.parameters()]), {path!r})
"""


def test_the_spin_count_changes_no_result(tmp_path):
    """Two threads, libgomp's own spin vs the bound: bit-equal weights after three training steps."""
    weights = []
    for spin in ("300000", str(BOUNDED_SPINCOUNT)):
        path = tmp_path / f"w{spin}.pt"
        env = {**os.environ, "GOMP_SPINCOUNT": spin}
        proc = subprocess.run([sys.executable, "-c", _STEPS.format(path=str(path))], env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        weights.append(torch.load(path))
    assert torch.equal(weights[0], weights[1])
