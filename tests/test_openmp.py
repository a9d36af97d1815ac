"""The ``monai-fast`` entry point bounds GNU OpenMP's spin before torch loads; the user's choice wins; results
unchanged.

libgomp itself is asked what it read (``OMP_DISPLAY_ENV=VERBOSE`` makes it print its settings when it
loads), so these tests check the setting that took effect, not only the environment.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from monai_fast.openmp import BOUNDED_SPINCOUNT, _int, bound_openmp_spin, libgomp_mapped, openmp_loaded, physical_cores


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
import os
import torch
from monai.networks.nets import UNet
from monai_fast.openmp import free_core, on_core, pin_openmp_workers
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
core = None
if os.environ.get("PIN") == "1":
    assert pin_openmp_workers() is not None
    core = free_core()
    assert core is not None
torch.manual_seed(0)
net = UNet(3, 1, 2, (8, 16, 32), (2, 2), num_res_units=1)
opt = torch.optim.AdamW(net.parameters(), 1e-2)
x = torch.randn(2, 1, 32, 32, 32)
for _ in range(3):
    with on_core(core):
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
        env = {**os.environ, "GOMP_SPINCOUNT": spin, "PIN": "0"}
        proc = subprocess.run(
            [sys.executable, "-c", _STEPS.format(path=str(path))],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        weights.append(torch.load(path))
    assert torch.equal(weights[0], weights[1])


_PIN = """
import json, os, sys, threading
import torch
torch.set_num_threads(int(sys.argv[1]))
from monai_fast.openmp import pin_openmp_workers

def masks():
    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}

before = masks()
note = pin_openmp_workers()
after = masks()
seen = {}
t = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))
t.start(); t.join()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, json.dumps(sorted(os.sched_getaffinity(0))).encode()); os._exit(0)
os.waitpid(pid, 0)
seen["child"] = json.loads(os.read(r, 4096))
print(json.dumps({"note": note, "main": threading.get_native_id(), "before": before, "after": after, **seen}))
"""


def _pin(threads: int, **extra: str) -> dict:
    """Run :func:`pin_openmp_workers` in a fresh process with ``threads`` torch threads; every thread's CPU mask."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "OMP_PROC_BIND",
            "OMP_PLACES",
            "GOMP_CPU_AFFINITY",
            "KMP_AFFINITY",
            "LOCAL_WORLD_SIZE",
            "MONAI_FAST_PIN_OPENMP",
        )
    }
    env.update(extra)
    proc = subprocess.run(
        [sys.executable, "-c", _PIN, str(threads)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


needs_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or not libgomp_mapped(), reason="pinning needs 2 or more cores and GNU OpenMP"
)


@needs_cores
def test_the_workers_get_a_core_each_and_the_main_thread_its_threads_and_its_children_keep_every_core():
    cores = physical_cores()
    doc = _pin(len(cores))
    allowed = sorted(os.sched_getaffinity(0))
    assert doc["note"] and "pinned one per core" in doc["note"]
    after = {int(t): m for t, m in doc["after"].items()}
    workers = {t: m for t, m in after.items() if str(t) not in doc["before"]}
    assert len(workers) == len(cores) - 1  # one per worker of the team, pinned
    assert sorted(tuple(m) for m in workers.values()) == sorted(tuple(sorted(c)) for c in cores[1:])
    assert after[doc["main"]] == allowed  # the main thread free...
    assert doc["thread"] == allowed and doc["child"] == allowed  # ...so a thread or a forked worker it starts is too


@needs_cores
@pytest.mark.parametrize(
    "threads, extra",
    [
        (None, {"MONAI_FAST_PIN_OPENMP": "0"}),
        (None, {"OMP_PROC_BIND": "close"}),
        (None, {"LOCAL_WORLD_SIZE": "2"}),
        (None, {"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}),
        (1, {}),
    ],
)
def test_nothing_is_pinned_where_it_could_crowd_or_the_user_chose(threads, extra):
    doc = _pin(threads or len(physical_cores()), **extra)
    allowed = sorted(os.sched_getaffinity(0))
    assert doc["note"] is None
    if "OMP_PROC_BIND" not in extra:  # (with it, libgomp binds the threads itself, as the user asked)
        assert all(m == allowed for m in doc["after"].values())


def test_the_leading_count_of_a_launchers_variable():
    assert [_int(v) for v in ("2(x3)", "4", "", "x", None)] == [2, 4, 0, 0, 0]


@needs_cores
def test_pinning_changes_no_result(tmp_path):
    """One thread per core, free vs workers pinned and the main thread on its core during the steps: bit-equal
    weights."""
    weights = []
    for pin in ("0", "1"):
        path = tmp_path / f"w{pin}.pt"
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_PROC_BIND", "OMP_PLACES", "MONAI_FAST_PIN_OPENMP")}
        proc = subprocess.run(
            [sys.executable, "-c", _STEPS.format(path=str(path))],
            env={**env, "PIN": pin, "THREADS": str(len(physical_cores()))},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        weights.append(torch.load(path))
    assert torch.equal(weights[0], weights[1])
