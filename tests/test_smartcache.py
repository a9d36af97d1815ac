import threading
import time

import ignite.distributed as idist
import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver
from monai.data import DataLoader, SmartCacheDataset
from monai.transforms import Lambdad

from monai_fast.apps.launch import free_port
from monai_fast.data.items import DataItemError
from monai_fast.data.smartcache import SafeSmartCacheDataset
from monai_fast.handlers import SmartCacheUpdater

ITEMS = [{"image": f"/data/image{i}.nii.gz", "id": i} for i in range(1, 6)]
GUIDE = [[1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 1], [4, 5, 1, 2], [5, 1, 2, 3]]


def _ds(items=ITEMS, fn=lambda x: x, replace_rate=0.25, cache_num=4, **kwargs):
    return SafeSmartCacheDataset(
        items,
        transform=Lambdad("id", fn),
        replace_rate=replace_rate,
        cache_num=cache_num,
        shuffle=False,
        progress=False,
        num_init_workers=1,
        num_replace_workers=1,
        **kwargs,
    )


def _engine(seen):
    engine = Engine(lambda e, b: seen[-1].append(int(b["id"][0])))
    engine.add_event_handler(Events.EPOCH_STARTED, lambda e: seen.append([]))
    return engine


def _run(ds, updater, epochs):
    seen = []
    engine = _engine(seen)
    updater.attach(engine)
    engine.run(DataLoader(ds, batch_size=1, shuffle=False), max_epochs=epochs)
    return seen


def test_guide_rotation_example():
    # the fast-training guide: 5 images, cache_num=4, replace_rate=0.25
    ds = _ds()
    seen = _run(ds, SmartCacheUpdater(ds), 5)
    assert seen == GUIDE
    assert ds.updates == 5 and not ds.is_started()  # the run's end stopped the thread


def test_the_dataset_alone_follows_monais_documented_rotation():
    ds = _ds()
    ds.start()
    seen = []
    for _ in range(5):
        seen.append([int(ds[i]["id"]) for i in range(len(ds))])
        ds.update_cache(timeout_s=5)
    ds.shutdown()
    assert seen == GUIDE and ds.window() == [0, 1, 2, 3]  # 5 swaps of 1 item: full circle


def test_a_rerun_cell_replaces_the_first_updater_and_rotates_once_per_epoch():
    ds = _ds()
    seen = []
    engine = _engine(seen)
    first = SmartCacheUpdater(ds)
    first.attach(engine)
    second = SmartCacheUpdater(ds)  # the cell runs again over the same dataset
    second.attach(engine)
    engine.run(DataLoader(ds, batch_size=1, shuffle=False), max_epochs=3)
    assert seen == GUIDE[:3]  # two updaters would have rotated twice: [1..4], [3, 4, 5, 1], ...
    assert ds.updates == 3
    assert not first.is_attached() and second.is_attached(engine)


def test_resume_through_ignite_checkpoint_continues_the_same_rotation(tmp_path):
    ds = _ds()
    seen = []
    engine = _engine(seen)
    updater = SmartCacheUpdater(ds)
    updater.attach(engine)  # before the Checkpoint, so an epoch-end save sees the rotated position
    engine.add_event_handler(
        Events.EPOCH_COMPLETED, Checkpoint({"trainer": engine, "smartcache": updater}, DiskSaver(tmp_path), n_saved=1)
    )
    engine.run(DataLoader(ds, batch_size=1, shuffle=False), max_epochs=2)
    (path,) = tmp_path.glob("*.pt")

    ds2 = _ds()
    rest = []
    engine2 = _engine(rest)
    updater2 = SmartCacheUpdater(ds2)
    updater2.attach(engine2)
    Checkpoint.load_objects({"trainer": engine2, "smartcache": updater2}, torch.load(path, weights_only=False))
    assert ds2.window() == [2, 3, 4, 0] and [int(ds2[i]["id"]) for i in range(4)] == [3, 4, 5, 1]
    engine2.run(DataLoader(ds2, batch_size=1, shuffle=False), max_epochs=4)
    assert seen + rest == GUIDE[:4]
    assert ds2.state_dict() == {"start_pos": 4, "updates": 4, "total": 5}


def test_several_replace_workers_and_set_data_restart_the_rotation():
    items = [{"image": f"/data/image{i}.nii.gz", "id": i} for i in range(1, 9)]
    ds = SafeSmartCacheDataset(
        items,
        transform=Lambdad("id", lambda x: x),
        replace_rate=0.5,
        cache_num=4,
        shuffle=False,
        progress=False,
        num_replace_workers=2,
    )
    assert ds.replace_num == 2
    ds.start()
    ds.update_cache(timeout_s=5)
    assert [int(ds[i]["id"]) for i in range(4)] == [3, 4, 5, 6] and ds.window() == [2, 3, 4, 5]
    ds.set_data(items[:6])  # stops the thread, re-caches the first items, restarts the rotation at 0
    assert not ds.is_started() and ds.window() == [0, 1, 2, 3] and ds.replace_num == 2
    ds.update_cache(timeout_s=5)
    ds.update_cache(timeout_s=5)
    ds.shutdown()
    assert [int(ds[i]["id"]) for i in range(4)] == [5, 6, 1, 2] and ds.state_dict()["start_pos"] == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU build")
@pytest.mark.parametrize("workers", [1, 2])
def test_the_rotation_beside_cpu_steps_runs_its_parallel_code_on_its_own_threads_alone(workers):
    main = torch.get_num_threads()
    if main < 2:
        pytest.skip("torch runs one intra-op thread here: nothing to keep apart")
    seen: list[tuple[str, int]] = []

    def note(x):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return x

    items = [{"image": f"/data/image{i}.nii.gz", "id": i} for i in range(1, 9)]
    ds = SafeSmartCacheDataset(
        items,
        transform=Lambdad("id", note),
        replace_rate=0.5,  # two replacements: with two workers, each in a worker thread
        cache_num=4,
        shuffle=False,
        progress=False,
        num_init_workers=1,
        num_replace_workers=workers,
    )
    seen.clear()  # the first window is made in this thread
    ds.start()
    ds.update_cache(timeout_s=5)
    ds.shutdown()
    assert seen and all(n == 1 for _, n in seen), seen  # the rotation thread, or its worker threads
    assert all(name != threading.current_thread().name for name, _ in seen)
    assert torch.get_num_threads() == main


def test_a_state_for_another_data_list_is_refused():
    with pytest.raises(ValueError, match="state is for 3 items"):
        _ds().load_state_dict({"start_pos": 1, "updates": 1, "total": 3})


def test_failing_replacement_is_raised_in_the_training_thread_naming_the_item():
    def fn(i):
        if i == 5:
            raise ValueError("corrupt volume")
        return i

    ds = _ds(fn=fn)  # items 1-4 are cached at construction; item 5 fails in the background
    t = time.monotonic()
    with pytest.raises(
        DataItemError, match=r"item 4 \(image=/data/image5\.nii\.gz\).*ValueError: corrupt volume"
    ) as info:
        _run(ds, SmartCacheUpdater(ds, timeout_s=30), 3)
    assert info.value.__cause__ is not None  # the original error is kept
    assert time.monotonic() - t < 20
    assert ds.window() == [0, 1, 2, 3] and ds.updates == 0  # the failed replacement was not swapped in


def _blocking(release: threading.Event):
    def fn(i):
        if i == 5:
            release.wait(30)  # a transform stuck on, say, a dead network mount
        return i

    return fn


def test_a_blocking_replacement_times_out_and_neither_hangs_the_run_nor_its_end():
    release = threading.Event()
    ds = _ds(fn=_blocking(release))
    t = time.monotonic()
    with pytest.raises(TimeoutError, match=r"longer than 1 s.*image5\.nii\.gz"):
        _run(ds, SmartCacheUpdater(ds, timeout_s=1.0), 2)
    assert time.monotonic() - t < 5
    assert not ds.is_started()  # the run's end abandoned the stuck thread instead of waiting on it
    release.set()


def test_the_dataset_times_out_on_its_own():
    release = threading.Event()
    ds = _ds(fn=_blocking(release), timeout_s=0.5)
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="longer than 0.5 s"):
        ds.update_cache()
    ds.shutdown()
    assert time.monotonic() - t < 3
    release.set()


def test_validation():
    with pytest.raises(TypeError, match="needs a monai.data.SmartCacheDataset.*got list"):
        SmartCacheUpdater([1, 2, 3])
    plain = SmartCacheDataset(ITEMS, cache_num=4, replace_rate=0.25, shuffle=False, progress=False)
    assert SmartCacheUpdater(plain).mode is None  # MONAI's own is accepted; the mode is chosen at attach
    with pytest.raises(TypeError, match=r"holds no data, not a SmartCacheDataset.*SmartCacheUpdater\(dataset\)"):
        SmartCacheUpdater().attach(Engine(lambda e, b: None))  # a plain engine gets its data at run()
    with pytest.raises(ValueError, match="timeout_s"):
        SmartCacheUpdater(_ds(), timeout_s=0)
    with pytest.raises(ValueError, match="replace_rate"):
        _ds(replace_rate=0)


def _ddp_main(local_rank, out_dir):
    def fn(i):
        if idist.get_rank() == 1 and i == 5:
            raise ValueError("rank 1 cannot read item 5")
        return i

    ds = _ds(fn=fn)
    try:
        _run(ds, SmartCacheUpdater(ds, timeout_s=30), 3)
        msg = "no error"
    except RuntimeError as e:
        msg = str(e)
    with open(f"{out_dir}/rank{idist.get_rank()}.txt", "w") as f:
        f.write(msg)


def test_two_gloo_ranks_fail_together(tmp_path):
    # a real 2-process gloo group: rank 1's replacement fails; rank 0 must not carry on alone
    with idist.Parallel(backend="gloo", nproc_per_node=2, master_port=free_port(), start_method="fork") as parallel:
        parallel.run(_ddp_main, str(tmp_path))
    assert "rank 1 cannot read item 5" in (tmp_path / "rank1.txt").read_text()
    assert "failed on another rank" in (tmp_path / "rank0.txt").read_text()
