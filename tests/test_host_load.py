"""HostLoad: the CPU share other processes took while something was measured (real processes, not fakes)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from monai_fast.apps.demo.headline import format_headline, headline
from monai_fast.telemetry.host import BUSY_SHARE, HostLoad, describe_host_load

SPIN = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < {s}: pass\n"
WINDOW_S = 1.0


def _spin(seconds: float) -> None:
    exec(SPIN.format(s=seconds))


def _own_children_spinning(n: int) -> dict:
    """The share while ``n`` of our own child processes spin: our own work, not another job's."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spin, args=(WINDOW_S + 1.0,)) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # past their interpreters' start-up
    load = HostLoad().start()
    time.sleep(WINDOW_S)
    share = load.stop()
    for p in procs:
        p.join(60)  # a slow, busy host may need longer than the spin itself to end them
    return share


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:  # ended (or a zombie not yet reaped) while we looked
        return ""


def _strangers_spinning(n: int) -> dict:
    """The share while ``n`` processes that are not ours spin (orphaned through a shell that exits at once).

    They are waited for until they end: on a busy host one may start late and spin on into the next
    measurement, where it would count as another job's load.
    """
    mark = f"stranger {uuid.uuid4().hex}"
    script = f"{sys.executable} -c '{SPIN.format(s=WINDOW_S + 1.0)}# {mark}'"
    subprocess.run(["sh", "-c", " ".join([f"({script}) >/dev/null 2>&1 &"] * n)], check=True, timeout=30)
    time.sleep(0.5)
    me = psutil.Process()
    assert not [c for c in me.children(recursive=True) if "time.monotonic" in _cmdline(c)]  # not ours
    load = HostLoad().start()
    time.sleep(WINDOW_S)
    share = load.stop()
    strangers = [p for p in psutil.process_iter() if mark in _cmdline(p)]
    deadline = time.monotonic() + 60
    while any(_spinning(p) for p in strangers):  # they end on their own (their reaper is not us)
        assert time.monotonic() < deadline, strangers
        time.sleep(0.05)
    return share


def _spinning(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # ended
        return False


def test_other_processes_count_and_our_own_children_do_not():
    n = os.cpu_count() or 1
    own = _own_children_spinning(n)
    other = _strangers_spinning(n)
    assert own["cpus"] == other["cpus"] == psutil.cpu_count()
    assert 0.0 <= own["others_cpu_share"] <= 1.0 and 0.0 <= other["others_cpu_share"] <= 1.0
    # n spinners that are not ours take a large share of an otherwise quiet host; ours are subtracted
    assert other["others_cpu_share"] > own["others_cpu_share"] + 0.1, (own, other)
    assert abs(other["wall_s"] - WINDOW_S) < 1.0


def test_stop_before_start_is_refused():
    with pytest.raises(RuntimeError, match="before start"):
        HostLoad().stop()


def test_the_line_says_quiet_or_busy_and_the_headline_prints_it():
    quiet = {"others_cpu_share": BUSY_SHARE / 2, "cpus": 2, "wall_s": 30.0}
    busy = {"others_cpu_share": 0.48, "cpus": 2, "wall_s": 30.0}
    assert describe_host_load(quiet, "x").startswith("host: quiet during x (other processes took 5% of the 2 CPUs)")
    assert "48% of the 2 CPUs during x: a busy host" in describe_host_load(busy, "x")
    assert describe_host_load(None, "x") == "host: load not measured"
    doc = headline([], {}, {}, host=busy)
    assert doc["host"] == busy
    assert "host: other processes took 48% of the 2 CPUs during the epochs taken in turns" in format_headline(doc)
    assert "host:" not in format_headline(headline([], {}, {}))  # not measured: no line (an old results.json)


def test_our_children_that_end_inside_the_window_are_still_ours():
    # loader workers end with each epoch: once reaped, their CPU time is in children_*, still ours
    n = os.cpu_count() or 1
    load = HostLoad().start()
    procs = [mp.get_context("spawn").Process(target=_spin, args=(WINDOW_S,)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    ended = load.stop()
    assert all(p.exitcode == 0 for p in procs)
    other = _strangers_spinning(n)
    assert other["others_cpu_share"] > ended["others_cpu_share"] + 0.1, (ended, other)


def test_the_process_trees_cpu_time_counts_a_live_child_before_it_is_reaped():
    """A loader worker's CPU counts when spent: the epoch that used it sees it, not the one that reaps it later."""
    from monai_fast.telemetry.host import process_tree_cpu_seconds

    # the child spins one second of its own CPU time (however busy the host), then waits, alive
    spin_cpu = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", spin_cpu], stdin=subprocess.PIPE)
    try:
        cpu = psutil.Process(child.pid)
        time.sleep(0.3)
        before = process_tree_cpu_seconds()
        child_before = sum(cpu.cpu_times()[:2])
        deadline = time.monotonic() + 30
        while sum(cpu.cpu_times()[:2]) - child_before < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        child_spent = sum(cpu.cpu_times()[:2]) - child_before
        spent = process_tree_cpu_seconds() - before
        assert child.poll() is None  # still alive, not yet reaped
        assert child_spent >= 0.5 and spent >= child_spent - 0.02, (spent, child_spent)
    finally:
        child.communicate(b"", timeout=30)
