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
    atomic_path,
    atomic_write,
    ensure_free_space,
    no_space_in,
    write_bytes,
    write_json,
)
from monai_fast.folders import RunFolderBusyError, RunFolderLock


@pytest.fixture
def small_fs(tmpfs):
    """A real 1 MiB tmpfs (the ``tmpfs`` fixture of ``tests/conftest.py``)."""
    return tmpfs("size=1M")


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
        "from monai_fast.folders import RunFolderLock\n"
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
    proc_code = f"from monai_fast.folders import RunFolderLock; RunFolderLock({str(tmp_path)!r}).acquire()"
    busy = subprocess.run([sys.executable, "-c", proc_code], capture_output=True, text=True)
    assert busy.returncode != 0 and "in use by another run" in busy.stderr  # still held by `second`
    second.release()
    free = subprocess.run([sys.executable, "-c", proc_code], capture_output=True, text=True)
    assert free.returncode == 0, free.stderr


def test_torch_save_on_a_full_disk_is_named_not_unexpected_pos(small_fs):
    import torch

    target = small_fs / "item.pt"
    with pytest.raises(NoSpaceError) as info:  # torch's zip writer raises "unexpected pos" over the ENOSPC
        with atomic_write(target, "wb") as f:
            torch.save(torch.zeros(400_000), f)
    assert str(target) in str(info.value) and "unexpected pos" not in str(info.value)
    assert list(small_fs.iterdir()) == []


def test_a_writer_that_takes_a_path_gets_the_same_guarantees(small_fs):
    import torch

    target = small_fs / "trace.json"
    target.write_text("old")
    with pytest.raises(NoSpaceError, match="trace.json"):
        with atomic_path(target) as tmp:
            torch.save(torch.zeros(400_000), str(tmp))  # opens the file itself
    assert target.read_text() == "old" and sorted(p.name for p in small_fs.iterdir()) == ["trace.json"]


def test_atomic_path_renames_a_complete_file_and_refuses_a_missing_one(tmp_path):
    with atomic_path(tmp_path / "small.json") as tmp:
        tmp.write_text("{}")
    assert (tmp_path / "small.json").read_text() == "{}" and sorted(tmp_path.iterdir()) == [tmp_path / "small.json"]
    with pytest.raises(FileNotFoundError, match="none.json"):
        with atomic_path(tmp_path / "none.json"):
            pass


def test_a_known_size_says_how_much_is_missing(small_fs):
    with pytest.raises(NoSpaceError) as info:
        write_bytes(b"x" * 3 * 2**20, small_fs / "model.pth")
    assert info.value.needed == 3 * 2**20 and "3.0 MiB" in str(info.value) and "missing" in str(info.value)
    assert list(small_fs.iterdir()) == []


class _FullDiskItems:
    def __init__(self, folder):
        self.folder = folder

    def __len__(self):
        return 2

    def __getitem__(self, i):
        raise NoSpaceError(self.folder / f"item{i}.pt", needed=2**20, free=0)


def test_no_space_from_a_loader_worker_keeps_its_one_line(tmp_path):
    from torch.utils.data import DataLoader

    with pytest.raises(NoSpaceError) as info:  # the worker re-raises type(err)(traceback text)
        next(iter(DataLoader(_FullDiskItems(tmp_path), num_workers=1)))
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(tmp_path / "item0.pt")) and "missing" in text
    assert no_space_in(RuntimeError("wrapped")) is None
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.bin"))
        except OSError:
            raise RuntimeError("unexpected pos 1152 vs 1046")  # noqa: B904 - as torch's writer raises it
    except RuntimeError as wrapped:
        found = no_space_in(wrapped)
    assert isinstance(found, NoSpaceError) and str(tmp_path / "x.bin") in str(found)


def test_a_file_system_out_of_inodes_says_so(tmpfs):
    mnt = tmpfs("size=4M,nr_inodes=3", "few-inodes")
    written = []
    with pytest.raises(NoSpaceError) as info:
        for i in range(10):
            written.append(write_json({"i": i}, mnt / f"f{i}.json"))
    assert "no free inodes" in str(info.value) and str(mnt) in str(info.value)
    assert written and all(p.exists() for p in written)  # what was written before is kept


def test_a_forked_child_that_ends_leaves_the_parent_owning_its_folder(tmp_path):
    lock = RunFolderLock(tmp_path).acquire()  # a DataLoader worker forked by the run inherits the lock's descriptor
    try:
        pid = os.fork()
        if pid == 0:  # the child collects what it inherited (the at-fork hooks have run) and ends
            import gc

            gc.collect()
            os._exit(0)
        os.waitpid(pid, 0)
        code = f"from monai_fast.folders import RunFolderLock; RunFolderLock({str(tmp_path)!r}).acquire()"
        busy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert busy.returncode != 0 and f"pid {os.getpid()}" in busy.stderr
    finally:
        lock.release()
    assert not list(tmp_path.iterdir())  # the last release removed the lock file
