"""A transform that blocks forever must not hang the loader: the watchdog (``timeout_s``) raises in
the training thread naming the item, for the loader thread and for worker processes."""

from __future__ import annotations

import gc
import threading
import time

import psutil
import pytest
from monai.data import Dataset
from monai.transforms import Compose, Lambdad, LoadImaged

from monai_fast.data.items import LoaderTimeoutError
from monai_fast.data.loaders import SafeThreadDataLoader

RELEASE = threading.Event()  # never set in a worker process (a forked copy): it blocks for good


@pytest.fixture
def release():
    RELEASE.clear()
    yield RELEASE
    RELEASE.set()  # lets an abandoned loader thread finish


def _dataset(files, target, action):
    def maybe(img):
        if img.meta["filename_or_obj"] == target:
            action()
        return img

    return Dataset(files, Compose([LoadImaged(keys=["image", "label"]), Lambdad(keys="image", func=maybe)]))


def _files(tiny_files):
    train, val = tiny_files
    return (train + val)[:5]


def _new_children(before):
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]


def test_thread_loader_stuck_item_raises_naming_item_3_and_abandons_its_thread(tiny_files, release):
    files = _files(tiny_files)
    # 6 s: items 0-2 (a few ms each) load within it on a busy host too. The garbage of the tests before
    # (torch DataLoader iterators whose clean-up joins worker processes for up to 5 s each) is collected
    # here, not by the collector in the loader thread in the middle of item 1.
    gc.collect()
    loader = SafeThreadDataLoader(_dataset(files, files[3]["image"], release.wait), batch_size=1, timeout_s=6)
    seen, start = 0, time.monotonic()
    gc.disable()
    try:
        with pytest.raises(LoaderTimeoutError, match=r"timeout_s=6 s.*loading item 3 \(image=.*, label=.*\)") as info:
            for _ in loader:
                seen += 1
    finally:
        gc.enable()
    assert time.monotonic() - start < 15 and seen == 3
    assert files[3]["image"] in str(info.value) and files[3]["label"] in str(info.value)
    abandoned = [t for t in threading.enumerate() if t.name == "monai-fast-loader (abandoned)"]
    assert len(abandoned) == 1 and abandoned[0].daemon
    release.set()
    abandoned[0].join(10)
    assert not abandoned[0].is_alive()  # once unblocked it stops instead of producing on


def test_worker_process_stuck_item_raises_naming_the_option_and_leaves_no_worker(tiny_files, caplog):
    files = _files(tiny_files)
    threads_before = set(threading.enumerate())
    ds = _dataset(files, files[3]["image"], lambda: threading.Event().wait())
    # 3 s: the worker's start-up and items 0-2 fit within it on a busy host too (the first batch includes the start)
    loader = SafeThreadDataLoader(ds, batch_size=1, num_workers=1, timeout_s=3)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    seen, start = 0, time.monotonic()
    expected = r"worker processes within timeout_s=3 s: batch 4 of the epoch"
    with pytest.raises(LoaderTimeoutError, match=expected) as info:
        for _ in loader:
            seen += 1
    assert time.monotonic() - start < 30 and seen == 3
    assert f"item 3 (image={files[3]['image']}" in str(info.value)
    assert _new_children(before) == []
    # the loader thread itself was healthy (the workers timed out): it stopped, nothing was abandoned
    assert [t.name for t in set(threading.enumerate()) - threads_before if t.name.startswith("monai-fast-loader")] == []
    assert "did not stop" not in caplog.text


@pytest.mark.parametrize("workers", [0, 1])
def test_slow_item_below_the_timeout_still_loads(tiny_files, workers):
    files = _files(tiny_files)
    ds = _dataset(files, files[3]["image"], lambda: time.sleep(0.5))
    batches = list(SafeThreadDataLoader(ds, batch_size=1, num_workers=workers, timeout_s=20))
    assert [b["image"].meta["filename_or_obj"][0] for b in batches] == [f["image"] for f in files]


def test_timeout_s_must_be_positive_or_none():
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        SafeThreadDataLoader(Dataset([1, 2]), timeout_s=0)
    assert SafeThreadDataLoader(Dataset([1, 2]), timeout_s=None).timeout_s is None
