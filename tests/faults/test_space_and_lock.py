"""The ground floor's two guards: a full file system named with the space missing, one run per folder.

Real parts: a 1 MiB tmpfs mounted for the test (root only; skipped with the reason otherwise), real
processes holding and losing the run-folder lock (a SIGKILL included).
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from monai_fast.files import (
    NoSpaceError,
    RunFolderBusyError,
    RunFolderLock,
    atomic_write,
    ensure_free_space,
    write_json,
)


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs, unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_names_the_file_and_keeps_the_old_content(small_fs):
    target = small_fs / "epochs.csv"
    target.write_text("epoch,loss\n1,0.5\n")
    with pytest.raises(NoSpaceError) as info:
        with atomic_write(target, "wb") as f:
            f.write(b"x" * 3_000_000)
    err = info.value
    assert err.errno == errno.ENOSPC and isinstance(err, OSError)
    assert str(target) in str(err) and "no space" in str(err)
    assert err.written is not None and err.written > 0
    assert err.free is not None and err.free > 500_000  # measured after the partial file went
    assert target.read_text() == "epoch,loss\n1,0.5\n"  # untouched
    assert sorted(p.name for p in small_fs.iterdir()) == ["epochs.csv"]  # no temporary file left
    copy = pickle.loads(pickle.dumps(err))  # crosses a worker process intact
    assert isinstance(copy, NoSpaceError) and str(copy) == str(err) and copy.path == err.path


def test_write_json_on_a_full_disk_raises_no_space(small_fs):
    with pytest.raises(NoSpaceError, match="results.json"):
        write_json({"x": "y" * 2_000_000}, small_fs / "results.json")
    assert not (small_fs / "results.json").exists()


def test_ensure_free_space_refuses_before_work(small_fs, tmp_path):
    with pytest.raises(NoSpaceError) as info:
        ensure_free_space(small_fs / "out" / "model.pth", 5 * 2**20, what="model")
    text = str(info.value)
    assert "model" in text and "model.pth" in text and "missing" in text
    assert ensure_free_space(tmp_path / "not" / "yet" / "there", 1) > 0  # nearest existing parent measured


def _hold(folder: Path, seconds: float) -> subprocess.Popen:
    code = (
        "import sys, time\n"
        "from monai_fast.files import RunFolderLock\n"
        f"RunFolderLock({str(folder)!r}, what='the test run').acquire()\n"
        "print('held', flush=True)\n"
        f"time.sleep({seconds})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_in_one_folder_is_refused_naming_the_owner(tmp_path):
    proc = _hold(tmp_path, 30)
    try:
        with pytest.raises(RunFolderBusyError) as info:
            RunFolderLock(tmp_path).acquire()
        assert str(tmp_path) in str(info.value) and f"pid {proc.pid}" in str(info.value)
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_owner_leaves_no_lock_behind(tmp_path):
    proc = _hold(tmp_path, 30)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while True:
        try:
            lock = RunFolderLock(tmp_path).acquire()
            break
        except RunFolderBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert lock.held
    lock.release()


def test_the_same_process_may_take_its_own_folder_again(tmp_path):
    first = RunFolderLock(tmp_path).acquire()
    second = RunFolderLock(tmp_path).acquire()  # a notebook cell run again
    first.release()
    proc_code = f"from monai_fast.files import RunFolderLock; RunFolderLock({str(tmp_path)!r}).acquire()"
    busy = subprocess.run([sys.executable, "-c", proc_code], capture_output=True, text=True)
    assert busy.returncode != 0 and "in use by another run" in busy.stderr  # still held by `second`
    second.release()
    free = subprocess.run([sys.executable, "-c", proc_code], capture_output=True, text=True)
    assert free.returncode == 0, free.stderr
