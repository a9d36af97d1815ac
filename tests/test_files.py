"""The ground floor: atomic writes, stale temporary files of killed writers, the cache folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import in_child_as_another_user

from monai_fast.files import atomic_write, clean_stale_tmp, tmp_path_for, write_json, write_text
from monai_fast.folders import cache_root


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = write_text("old", tmp_path / "a.txt")
    with pytest.raises(RuntimeError, match="boom"), atomic_write(target) as f:
        f.write("half of the new")
        raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        p = write_json({"a": 1}, tmp_path / "x.json", fsync=True)
    finally:
        os.umask(old)
    assert p.stat().st_mode & 0o777 == 0o644
    assert json.loads(p.read_text()) == {"a": 1}


def _writer_killed_mid_write(folder: Path) -> Path:
    """A real process that opens an atomic write, writes half, and is killed with SIGKILL."""
    code = textwrap.dedent(f"""
        import sys, time
        from monai_fast.files import atomic_write
        with atomic_write({str(folder / "results.json")!r}) as f:
            f.write('{{"half": ')
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    leftovers = list(folder.glob(".results.json.*.tmp"))
    assert len(leftovers) == 1, "the writer's temporary file should exist while it writes"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    return leftovers[0]


def test_a_killed_writers_temporary_is_cleaned_by_the_next_write(tmp_path):
    leftover = _writer_killed_mid_write(tmp_path)
    assert leftover.exists() and not (tmp_path / "results.json").exists()
    write_json({"complete": True}, tmp_path / "results.json")
    assert not leftover.exists()
    assert json.loads((tmp_path / "results.json").read_text()) == {"complete": True}


def test_clean_stale_tmp_keeps_live_writers_and_foreign_files(tmp_path):
    live = tmp_path_for(tmp_path / "mine.bin")  # this process is alive
    live.write_text("in progress")
    foreign = tmp_path / ".someone_elses.tmp"  # not named by tmp_path_for
    foreign.write_text("x")
    other_host = tmp_path / ".f.json.otherhost-123.abcd1234.tmp"
    other_host.write_text("x")
    dead = _writer_killed_mid_write(tmp_path)
    assert clean_stale_tmp(tmp_path) == [dead]
    assert live.exists() and foreign.exists() and other_host.exists()
    old = time.time() - 3 * 86400
    os.utime(other_host, (old, old))
    assert clean_stale_tmp(tmp_path, max_age_s=86400) == [other_host]


def test_a_live_writer_that_this_user_may_not_signal_keeps_its_temporary():
    """``os.kill(pid, 0)`` answers PermissionError for another user's process: alive, so its file stays."""
    with tempfile.TemporaryDirectory() as shared:  # under the system's temporary folder, which every user reaches
        folder = Path(shared)
        folder.chmod(0o777)
        live = tmp_path_for(folder / "theirs.json")  # written by this live process
        if os.geteuid() != 0:  # pid 1 belongs to root: the child, not root, may not signal it
            live = live.with_name(live.name.replace(f"-{os.getpid()}.", "-1."))
            assert "-1." in live.name
        live.write_text("in progress")

        def clean_and_list() -> list[str]:
            clean_stale_tmp(folder)
            return [p.name for p in folder.iterdir()]

        assert in_child_as_another_user(clean_and_list) == str([live.name])


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"MONAI_FAST_CACHE": "/srv/mf"}, "/srv/mf"),
        ({"MONAI_FAST_CACHE": "", "XDG_CACHE_HOME": "/xdg"}, "/xdg/monai-fast"),
        ({"XDG_CACHE_HOME": ""}, "~/.cache/monai-fast"),
        ({"XDG_CACHE_HOME": "relative/dir"}, "~/.cache/monai-fast"),
        ({}, "~/.cache/monai-fast"),
    ],
)
def test_cache_root_and_every_user_of_it_agree(monkeypatch, env, expected):
    from monai_fast.tune import default_store_path

    for name in ("MONAI_FAST_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    root = Path(os.path.expanduser(expected))
    assert cache_root() == root
    assert default_store_path() == root / "tuning.json"


def test_a_disk_cache_cleans_its_folder_once_not_on_every_item(tiny_files, tmp_path, monkeypatch):
    """Listing the folder on every write made building a cache of n items cost n listings of n files."""
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged

    import monai_fast.files as files
    from monai_fast.data.persistent import TrustedPersistentDataset

    cache = tmp_path / "cache"
    cache.mkdir()
    leftover = _writer_killed_mid_write(cache)  # a killed writer's temporary in the cache folder
    ds = TrustedPersistentDataset(
        tiny_files[0],
        Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"])]),
        cache,
    )
    assert not leftover.exists(), "the data set removes leftovers of killed writers when it opens its folder"
    calls = []
    real = files.clean_stale_tmp
    monkeypatch.setattr(files, "clean_stale_tmp", lambda *a, **k: calls.append(a) or real(*a, **k))
    for i in range(len(ds)):
        ds[i]
    assert len(list(cache.glob("*.pt"))) == len(tiny_files[0]) and calls == []
