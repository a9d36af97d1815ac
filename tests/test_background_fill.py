"""The background cache fill: training starts at once, the first epoch is exact, later epochs as today."""

from __future__ import annotations

import threading

import pytest
import torch
from background_parts import Held, case_names, chain, planned, trainer, write_cases
from ignite.engine import Events
from monai.data import CacheDataset, Dataset
from monai.transforms import Compose, Lambdad
from torch.utils.data import DataLoader, DistributedSampler

from monai_fast.data.adopt import adopt_loader
from monai_fast.data.background import BackgroundCacheDataset, fill_order_options
from monai_fast.data.loaders import SafeThreadDataLoader
from monai_fast.data.planner import plan_cache, rank_partition


def _loader(ds, seed: int = 0) -> SafeThreadDataLoader:
    return SafeThreadDataLoader(
        ds, batch_size=2, **fill_order_options(ds, shuffle=True, generator=torch.Generator().manual_seed(seed))
    )


def test_training_first_iteration_starts_before_the_fill_finishes(tmp_path):
    files = write_cases(tmp_path)
    held = Held(hold=("case_0",))  # the fill thread's first item, released only by the first iteration (else 20 s)
    ds = planned(files, held, background=True)
    t, _, times = trainer(_loader(ds), epochs=1)
    t.add_event_handler(Events.ITERATION_COMPLETED, lambda e: held.release.set())
    t.run()
    assert isinstance(ds, BackgroundCacheDataset)
    assert not held.timed_out
    assert times["first_iteration"] < held.done["case_0"]


def test_fill_threads_beside_cpu_steps_run_their_parallel_code_each_on_itself_alone(tmp_path):
    if torch.get_num_threads() < 2 or torch.cuda.is_available():
        pytest.skip("checks a CPU build with more than one intra-op thread")
    files = write_cases(tmp_path)
    seen: list[tuple[str, int]] = []

    def note(image):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return image

    transform = Compose([*chain(Held(), random=False).transforms, Lambdad("image", note)])
    plan = plan_cache(Compose(transform.transforms[:2]), files[:1], "cpu", ram_budget_mib=1024, sample=1)
    ds = plan.build(files, transform, background=True, num_workers=2)
    assert ds.wait(60)
    assert len(seen) == len(files) and {n for _, n in seen} == {1}, seen
    assert all(name.startswith("monai-fast-fill-") for name, _ in seen)


def test_first_epoch_over_a_partial_cache_sees_every_item_exactly_once(tmp_path):
    files = write_cases(tmp_path)
    held = Held(sleep_s=0.05)
    ds = planned(files, held, background=True)
    loader = _loader(ds)
    t, seen, _ = trainer(loader, epochs=1)
    t.run()
    assert loader.sampler.partial_epochs == 1
    assert sorted(seen[0]) == sorted(f"case_{i}" for i in range(8))


def test_epochs_after_the_fill_follow_the_foreground_order_for_the_same_seed(tmp_path):
    files = write_cases(tmp_path)
    runs = {}
    for background in (False, True):
        held = Held(hold=("case_0",) if background else ())  # the fill's first item, held until the first iteration
        loader = _loader(planned(files, held, background=background), seed=7)
        t, seen, _ = trainer(loader, epochs=3)
        t.add_event_handler(Events.ITERATION_COMPLETED, lambda e, h=held: h.release.set())
        t.run()
        runs[background] = seen
    assert loader.sampler.partial_epochs == 1  # the background run's first epoch did start over a partial cache
    assert runs[True][1:] == runs[False][1:]
    assert sorted(runs[True][0]) == sorted(runs[False][0])


def test_background_cache_contents_equal_the_foreground_fill(tmp_path):
    files = write_cases(tmp_path)
    fore = planned(files, Held(), background=False, random=False)
    back = planned(files, Held(sleep_s=0.02), background=True, random=False, workers=3)
    assert back.wait(60)
    assert isinstance(fore, CacheDataset) and not isinstance(fore, BackgroundCacheDataset)
    for i in range(len(files)):
        a, b = fore[i], back[i]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), (i, k)
            assert a[k].meta["filename_or_obj"] == b[k].meta["filename_or_obj"]


def test_adopt_loader_background_fills_only_this_ranks_share(tmp_path):
    files = write_cases(tmp_path)
    held = Held(sleep_s=0.05)
    user = DataLoader(
        Dataset(files, chain(held)),
        batch_size=2,
        sampler=DistributedSampler(Dataset(files), num_replicas=2, rank=1, shuffle=True, seed=3),
    )
    adopted = adopt_loader(user, cache="ram", background=True, cache_threads=1)
    share = rank_partition(files, 1, 2, seed=3)
    assert isinstance(adopted.dataset, BackgroundCacheDataset)
    assert adopted.dataset.data == share
    seen = [name for batch in adopted.loader for name in case_names(batch)]
    assert adopted.loader.sampler.partial_epochs == 1
    assert sorted(seen) == sorted(f["image"].split("/")[-1].split(".")[0] for f in share)


def test_validation_cache_after_the_training_cache_waits_for_it(tmp_path):
    files = write_cases(tmp_path)
    held = Held(hold=("case_0",))
    train = planned(files[:4], held, background=True)
    val = BackgroundCacheDataset(files[4:], chain(Held(), random=False), num_workers=2, after=train, copy_cache=False)
    assert not train.wait(0.5)
    assert val.fill.done == 0
    first = val[0]  # validation reads: that one item is made now, not after the training fill
    assert first["image"].meta["filename_or_obj"] == files[4]["image"]
    held.release.set()
    assert train.wait(60) and val.wait(60)
