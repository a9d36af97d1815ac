import time

import ignite.distributed as idist
import pytest
from ignite.engine import Engine, Events
from monai.data import DataLoader, SmartCacheDataset
from monai.transforms import Lambdad

from monai_fast.handlers import SmartCacheUpdater

ITEMS = [{"image": f"/data/image{i}.nii.gz", "id": i} for i in range(1, 6)]


def _ds(items=ITEMS, fn=lambda x: x, replace_rate=0.25, cache_num=4):
    return SmartCacheDataset(items, transform=Lambdad("id", fn), replace_rate=replace_rate, cache_num=cache_num,
                             shuffle=False, progress=False, num_init_workers=1, num_replace_workers=1)


def _run(ds, updater, epochs):
    seen = []
    engine = Engine(lambda e, b: seen[-1].append(int(b["id"][0])))
    engine.add_event_handler(Events.EPOCH_STARTED, lambda e: seen.append([]))
    updater.attach(engine)
    engine.run(DataLoader(ds, batch_size=1, shuffle=False), max_epochs=epochs)
    return seen


def test_guide_rotation_example():
    # the fast-training guide: 5 images, cache_num=4, replace_rate=0.25
    ds = _ds()
    seen = _run(ds, SmartCacheUpdater(ds), 5)
    assert seen == [[1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 1], [4, 5, 1, 2], [5, 1, 2, 3]]


def test_resume_continues_the_same_rotation():
    ds = _ds()
    up = SmartCacheUpdater(ds)
    first = _run(ds, up, 2)
    state = up.state_dict()
    assert state["start_pos"] == 2 and state["updates"] == 2

    ds2 = _ds()
    up2 = SmartCacheUpdater(ds2)
    up2.load_state_dict(state)
    assert up2.window() == [2, 3, 4, 0]
    rest = _run(ds2, up2, 2)
    assert first + rest == [[1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 1], [4, 5, 1, 2]]
    with pytest.raises(ValueError, match="state is for 3 items"):
        SmartCacheUpdater(_ds()).load_state_dict({**state, "total": 3})


def test_failing_replacement_is_raised_with_the_file_not_a_hang():
    def fn(i):
        if i == 5:
            raise ValueError("corrupt volume")
        return i

    ds = _ds(fn=fn)  # items 1-4 are cached at construction; item 5 fails in the background
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"image5\.nii\.gz.*corrupt volume|corrupt volume.*image5"):
        _run(ds, SmartCacheUpdater(ds, timeout_s=30), 3)
    assert time.monotonic() - t < 20


def test_slow_replacement_times_out():
    def fn(i):
        if i == 5:
            time.sleep(2.0)
        return i

    ds = _ds(fn=fn)
    with pytest.raises(TimeoutError, match="longer than 0 s|longer than"):
        _run(ds, SmartCacheUpdater(ds, timeout_s=0.3), 2)


def test_validation():
    with pytest.raises(TypeError, match="SmartCacheDataset"):
        SmartCacheUpdater([1, 2, 3])
    with pytest.raises(ValueError, match="timeout_s"):
        SmartCacheUpdater(_ds(), timeout_s=0)


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
    with idist.Parallel(backend="gloo", nproc_per_node=2, start_method="fork") as parallel:
        parallel.run(_ddp_main, str(tmp_path))
    assert "rank 1 cannot read item 5" in (tmp_path / "rank1.txt").read_text()
    assert "failed on another rank" in (tmp_path / "rank0.txt").read_text()


def test_a_hanging_replacement_neither_hangs_the_run_nor_its_end():
    release = {"go": False}

    def fn(i):
        while i == 5 and not release["go"]:
            time.sleep(0.05)  # a transform stuck on, say, a dead network mount
        return i

    ds = _ds(fn=fn)
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        _run(ds, SmartCacheUpdater(ds, timeout_s=0.5), 2)
    assert time.monotonic() - t < 10
    release["go"] = True
