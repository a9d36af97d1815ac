import threading
import weakref

import pytest
import torch
from conftest import in_child_as_another_user
from monai.data import CacheDataset, Dataset, ThreadDataLoader
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandLambdad

from monai_fast.data.items import DataItemError
from monai_fast.data.loaders import SafeThreadDataLoader
from monai_fast.telemetry.cuda import cuda_available


def _loader_threads():
    return [t for t in threading.enumerate() if t.name == "monai-fast-loader"]


def _files(tiny_files):
    train, val = tiny_files
    return train + val


def test_truncated_nifti_is_named_not_hidden(tiny_files, tmp_path):
    files = [dict(d) for d in _files(tiny_files)]
    bad = tmp_path / "spleen_bad.nii.gz"
    bad.write_bytes(open(files[3]["image"], "rb").read()[:200])  # a truncated copy of a real file
    files[3]["image"] = str(bad)
    ds = Dataset(files, Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"])]))
    loader = SafeThreadDataLoader(ds, batch_size=1, shuffle=False)
    seen = 0
    with pytest.raises(DataItemError, match=r"item 3 \(image=.*spleen_bad\.nii\.gz, label=.*\.nii\.gz\)"):
        for _ in loader:
            seen += 1
    assert seen == 3 and _loader_threads() == []


@pytest.mark.parametrize("prefetch", [True, False])  # made in the loader thread, or in this one on demand
def test_raising_random_transform_on_cached_data_is_named(tiny_files, prefetch):
    files = _files(tiny_files)
    target = files[1]["image"]

    def maybe_fail(img):
        if img.meta["filename_or_obj"] == target:
            raise ValueError("augmentation exploded")
        return img

    chain = Compose([LoadImaged(keys=["image", "label"]), RandLambdad(keys="image", func=maybe_fail, prob=1.0)])
    ds = CacheDataset(files, chain, progress=False)
    with pytest.raises(DataItemError, match=r"item 1 .*augmentation exploded") as info:
        list(SafeThreadDataLoader(ds, batch_size=2, prefetch=prefetch))
    assert target in str(info.value) and isinstance(info.value.__cause__, RuntimeError) and _loader_threads() == []


def test_same_batches_as_monai_thread_loader_when_nothing_fails():
    data = [{"x": torch.tensor([float(i)])} for i in range(7)]
    ours = [b["x"].tolist() for b in SafeThreadDataLoader(Dataset(data), batch_size=3, repeats=2)]
    theirs = [b["x"].tolist() for b in ThreadDataLoader(Dataset(data), batch_size=3, repeats=2)]
    assert ours == theirs and len(ours) == 6


def test_breaking_early_leaves_no_thread():
    data = [{"x": torch.tensor([float(i)])} for i in range(50)]
    for i, _ in enumerate(SafeThreadDataLoader(Dataset(data), batch_size=1)):
        if i == 2:
            break
    assert _loader_threads() == []


def _explode(x):
    raise OSError("disk gone")


def test_worker_process_errors_surface_too_and_the_workers_stop_with_them():
    import gc

    import psutil

    data = [{"x": torch.tensor([1.0])}] * 4
    ds = Dataset(data, RandLambdad(keys="x", func=_explode, prob=1.0))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    gc.disable()  # the workers stop as the error is raised, not when a collection finds their iterator
    try:
        with pytest.raises(DataItemError, match="disk gone") as info:
            list(SafeThreadDataLoader(ds, batch_size=2, num_workers=1))
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                if (
                    p.pid not in before
                    and p.status() != psutil.STATUS_ZOMBIE
                    and "resource_tracker" not in " ".join(p.cmdline())
                ):
                    left.append(p)
            except psutil.NoSuchProcess:  # ended while being looked at
                pass
        assert left == [], left
    finally:
        gc.enable()
    assert _loader_threads() == [] and "item 0" in str(info.value)


def test_fast_recipe_surfaces_a_failing_item_from_trainer_run(tiny_files, tiny_config):
    from monai_fast.apps.recipes import build_recipe

    r = build_recipe("fast", *tiny_files, tiny_config, progress=False)
    assert isinstance(r.train_loader, SafeThreadDataLoader)
    r.train_loader.dataset._cache[1]["image"] = None  # one broken cached item
    with pytest.raises(DataItemError, match=r"item 1 \(image="):
        r.trainer.run()


def _record_devices(monkeypatch, main_device):
    from monai_fast.data import loaders  # where the loader thread sets its device

    events = []
    monkeypatch.setattr(loaders, "current_cuda_device", lambda: main_device)  # the hardware edge
    name = threading.current_thread
    monkeypatch.setattr(loaders, "set_cuda_device", lambda d: events.append(("set", name().name, d)))
    data = [{"x": torch.tensor([float(i)])} for i in range(3)]
    ds = Dataset(data, RandLambdad(keys="x", func=lambda x: events.append(("item", name().name)) or x, prob=1.0))
    return events, ds


def test_loader_thread_sets_the_main_threads_cuda_device_before_producing(monkeypatch):
    events, ds = _record_devices(monkeypatch, torch.device("cuda", 1))
    assert len(list(SafeThreadDataLoader(ds, batch_size=1))) == 3
    assert events[0] == ("set", "monai-fast-loader", torch.device("cuda", 1))
    assert events[1:] == [("item", "monai-fast-loader")] * 3


@pytest.mark.skipif(cuda_available(), reason="checks the CPU build")
def test_loader_thread_sets_no_cuda_device_without_cuda(monkeypatch):
    from monai_fast.telemetry.cuda import current_cuda_device

    events, ds = _record_devices(monkeypatch, current_cuda_device())  # the real wrapper on this CPU build
    assert len(list(SafeThreadDataLoader(ds, batch_size=1))) == 3
    assert [e for e in events if e[0] == "set"] == []


class _ThreadsSeen(torch.utils.data.Dataset):
    """Each item: the intra-op threads torch would use where it is made, and whether that is the loader thread."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([torch.get_num_threads(), threading.current_thread().name == "monai-fast-loader"])


@pytest.mark.skipif(cuda_available(), reason="checks the CPU build")
def test_a_loader_thread_beside_a_cpu_step_runs_its_parallel_code_alone_and_changes_no_other_threads_count():
    main = torch.get_num_threads()
    if main < 2:
        pytest.skip("torch runs one intra-op thread here: nothing to keep apart")
    batches = list(SafeThreadDataLoader(_ThreadsSeen(), batch_size=1, prefetch=True))
    assert [bool(b[0, 1]) for b in batches] == [True] * 3  # made ahead, in the loader thread
    assert [int(b[0, 0]) for b in batches] == [1] * 3
    on_demand = list(SafeThreadDataLoader(_ThreadsSeen(), batch_size=1, prefetch=False))
    assert [tuple(map(int, b[0])) for b in on_demand] == [(main, 0)] * 3  # made in this thread, with its own team
    later: list[int] = []
    started = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    started.start()
    started.join()
    assert torch.get_num_threads() == main and later == [main]  # torch's process-wide default untouched


def test_a_loader_thread_beside_a_cuda_step_keeps_torchs_team(monkeypatch):
    from monai_fast.data import loaders as thread_buffer

    main = torch.get_num_threads()
    monkeypatch.setattr(thread_buffer, "current_cuda_device", lambda: torch.device("cuda", 0))  # the hardware edge
    monkeypatch.setattr(thread_buffer, "set_cuda_device", lambda d: None)
    batches = list(SafeThreadDataLoader(_ThreadsSeen(), batch_size=1, prefetch=True))
    assert [tuple(map(int, b[0])) for b in batches] == [(main, 1)] * 3


@pytest.mark.gpu
def test_batch_made_through_todeviced_lands_on_the_main_threads_gpu():
    from monai.transforms import ToDeviced

    from monai_fast.telemetry.cuda import set_cuda_device

    last = torch.device("cuda", torch.cuda.device_count() - 1)
    set_cuda_device(last)
    try:
        ds = Dataset([{"x": torch.tensor([float(i)])} for i in range(4)], ToDeviced(keys="x", device="cuda"))
        devices = {b["x"].device for b in SafeThreadDataLoader(ds, batch_size=2)}
    finally:
        set_cuda_device(torch.device("cuda", 0))
    assert devices == {last}


class _Volumes(torch.utils.data.Dataset):
    """Each item a patch that is a view of a whole volume made for it, as a random crop of a cached copy is."""

    def __init__(self, n: int) -> None:
        self.n, self.volumes = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        volume = torch.full((1, 64, 64, 64), float(i))
        self.volumes.append(weakref.ref(volume))
        return {"image": volume[:, :8, :8, :8]}

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.volumes)


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_batch_does_not_keep_the_volumes_its_patches_were_cut_from(prefetch):
    ds = _Volumes(8)
    loader = SafeThreadDataLoader(ds, batch_size=2, prefetch=prefetch, buffer_size=1)
    held = []
    for batch in loader:
        assert batch["image"].shape == (2, 1, 8, 8, 8)
        held.append(ds.alive())  # while the training step runs on this batch
    # on demand: none (the patches were copied into the batch); ahead: at most the next batch's two in the making
    assert max(held) <= (2 if prefetch else 0), held
    assert ds.alive() == 0


def test_batches_made_on_demand_start_one_watchdog_thread_per_epoch_not_one_per_batch():
    started: set[threading.Thread] = set()  # the objects, kept alive: a thread's ident is reused once it ended
    threading.setprofile(lambda *a: started.add(threading.current_thread()))  # in each thread started from now
    try:
        batches = list(SafeThreadDataLoader(_Volumes(12), batch_size=1, prefetch=False, timeout_s=60))
    finally:
        threading.setprofile(None)
    assert len(batches) == 12
    threads = [t for t in started - {threading.current_thread()} if not t.name.startswith("Dummy")]  # a thread ending
    assert len(threads) == 1, threads  # the watchdog; a timer per batch would be 12


def test_a_loader_thread_the_system_refuses_raises_the_systems_error():
    """Under a process limit no new thread starts: the epoch raises that error, not one from joining."""
    loader = SafeThreadDataLoader(Dataset(list(range(4))), batch_size=1)
    assert in_child_as_another_user(lambda: list(loader), max_processes=1) == "RuntimeError: can't start new thread"
