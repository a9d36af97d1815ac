"""A SmartCache window over the crop-reading tier, on real NIfTI files and MONAI chains: the same crops as MONAI's
SmartCacheDataset, the window holding item numbers instead of volumes, and an item written once read back after."""

from __future__ import annotations

import pytest
import torch
from monai.data import DataLoader, SmartCacheDataset
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, MapTransform, RandCropByPosNegLabeld

from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.data.adopt import adopt_loader
from monai_fast.data.smartcache import SafeSmartCacheDataset, window_bytes

#: the files each LoadImaged of this module read, in order (module level: a counter in the transform's own state
#: would change its fingerprint, and with it the tier's key)
READ: list[str] = []


class CountedLoad(MapTransform):
    """MONAI's LoadImaged, counting what it reads."""

    def __init__(self, keys):
        super().__init__(keys)
        self.load = LoadImaged(keys)

    def __call__(self, data):
        READ.append(str(data["image"]))
        return self.load(data)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = generate_msd(tmp_path_factory.mktemp("msd"), "spleen-like", num_cases=6, shape=(40, 36, 24), progress=False)
    train, val = load_msd_datalist(root, val_fraction=0.2, seed=0)
    return train + val


def _chain() -> Compose:
    keys = ["image", "label"]
    return Compose(
        [
            CountedLoad(keys),
            EnsureChannelFirstd(keys),
            RandCropByPosNegLabeld(keys, "label", (16, 16, 16), pos=1, neg=1, num_samples=2, image_key="image"),
        ]
    )


def _crops(ds) -> list[torch.Tensor]:
    out = []
    for i in range(len(ds)):
        out += [torch.as_tensor(s["image"]).clone() for s in ds[i]]
    return out


def test_the_window_over_the_tier_gives_monais_crops_holds_no_volumes_and_reads_each_file_once(files, tmp_path):
    reference = SafeSmartCacheDataset(files, _chain(), 0.5, cache_num=2, shuffle=False, progress=False)
    tiered = SafeSmartCacheDataset(
        files, _chain(), 0.5, cache_num=2, shuffle=False, progress=False, cache_dir=tmp_path / "tier"
    )
    assert tiered.tier is not None and tiered.tier.reads_patches
    assert window_bytes(tiered) == 0 < window_bytes(reference)  # item numbers, not volumes
    READ.clear()
    cycles = 2 * len(files) // tiered.replace_num  # the whole data set rotates through the window twice
    for epoch in range(cycles):
        for ds in (reference, tiered):  # the same random stream for each epoch's crops
            ds.transform.set_random_state(seed=epoch)
        a, b = _crops(reference), _crops(tiered)
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), f"epoch {epoch}"
        assert reference.window() == tiered.window()
        for ds in (reference, tiered):
            ds.update_cache(timeout_s=60)
    tiered.shutdown()
    reference.shutdown()
    assert len(list((tmp_path / "tier").iterdir())) == len(files)  # each item written once, as arrays


def test_the_tier_loads_each_file_once_over_many_rotations(files, tmp_path):
    tiered = SafeSmartCacheDataset(
        files, _chain(), 0.5, cache_num=2, shuffle=False, progress=False, cache_dir=tmp_path / "tier"
    )
    READ.clear()
    for _ in range(3 * len(files) // tiered.replace_num):  # three whole cycles of the data set
        _crops(tiered)
        tiered.update_cache(timeout_s=60)
    tiered.shutdown()
    # two items were loaded at construction (before READ was cleared); the rest once each, never again
    assert sorted(READ) == sorted(str(x["image"]) for x in files[2:]), READ


def test_a_full_disk_keeps_the_rest_of_the_window_in_ram_and_in_place_transforms_never_change_it(files, tmpfs, caplog):
    class Zero(MapTransform):
        def __call__(self, data):
            d = dict(data)
            d["image"].mul_(0)  # in place, on the crop (a view of the item it was cut from)
            return d

    keys = ["image", "label"]
    chain = Compose(
        [
            LoadImaged(keys),
            EnsureChannelFirstd(keys),
            RandCropByPosNegLabeld(keys, "label", (16, 16, 16), pos=1, neg=1, num_samples=1, image_key="image"),
            Zero(keys),
        ]
    )
    folder = tmpfs("size=64k")  # one item's arrays fill it
    with caplog.at_level("WARNING", logger="monai_fast.data"):
        ds = SafeSmartCacheDataset(files, chain, 0.5, cache_num=2, shuffle=False, progress=False, cache_dir=folder)
    assert ds.tier.disk_full is not None and "is full" in caplog.text
    assert window_bytes(ds) > 0, ds._cache  # what did not fit is held in RAM, as MONAI holds it
    held = [x.item for x in ds._cache if hasattr(x, "item")]  # the slots computed in memory
    before = float(held[-1]["image"].abs().sum())
    for i in [*range(len(ds)), -1]:  # a negative index too, as a Dataset takes it
        assert ds[i][0]["image"].shape[-3:] == (16, 16, 16)
    assert before > 0 and float(held[-1]["image"].abs().sum()) == before  # the crops were zeroed, not the window
    ds.shutdown()


def test_fast_training_rotates_a_users_smartcache_over_the_tier_when_its_window_exceeds_the_ram_budget(files, tmp_path):
    user = SmartCacheDataset(files, _chain(), replace_rate=0.5, cache_num=2, shuffle=False, progress=False)
    window = window_bytes(user)
    loader = DataLoader(user, batch_size=1)
    small = adopt_loader(loader, "cpu", cache_dir=tmp_path / "tier", ram_budget_mib=window / 2 / 2**20)
    assert isinstance(small.dataset, SafeSmartCacheDataset) and small.dataset.tier is not None
    assert "rotates over a crop-reading tier" in small.notes[0] and "more than the RAM budget" in small.notes[0]
    batch = next(iter(small.loader))
    assert batch["image"].shape[-3:] == (16, 16, 16)
    small.dataset.shutdown()
    # a window within the budget stays in RAM, as MONAI cached it
    user = SmartCacheDataset(files, _chain(), replace_rate=0.5, cache_num=2, shuffle=False, progress=False)
    roomy = adopt_loader(DataLoader(user, batch_size=1), "cpu", cache_dir=tmp_path / "t2", ram_budget_mib=1024)
    assert roomy.dataset.tier is None and "tier" not in roomy.notes[0]
    roomy.dataset.shutdown()


def test_a_users_trainer_with_a_smartcache_beyond_its_ram_budget_trains_every_window_over_the_tier(
    tiny_files, tmp_path
):
    from ignite.engine import Events
    from monai.data import list_data_collate
    from monai.handlers import SmartCacheHandler
    from test_fast_training import _chain as user_chain
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining

    train_files, _ = tiny_files
    chain = user_chain(True)
    user = SmartCacheDataset(train_files, chain, replace_rate=0.5, cache_num=2, shuffle=False, progress=False)
    window = window_bytes(user)
    loader = DataLoader(user, batch_size=1, shuffle=True, collate_fn=list_data_collate)
    trainer, evaluator = _user_trainer(tiny_files, train_loader=loader, max_epochs=3)
    SmartCacheHandler(user).attach(trainer)  # the script rotates its window
    fast = FastTraining(ram_budget_mib=window / 2 / 2**20, cache_dir=tmp_path / "tier", compile=False, tune_store=None)
    fast.attach(trainer, evaluator)
    safe = SafeSmartCacheDataset.adoption_of(user)
    assert safe is not None and safe.tier is not None, fast.applied["data"]["reason"]
    assert "crop-reading tier" in fast.applied["data"]["reason"]
    assert window_bytes(user) == 0 == window_bytes(safe)  # the user's window released, the tier's holds numbers
    windows = []
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: windows.append(safe.window()))
    trainer.run()
    assert trainer.state.epoch == 3 and len({tuple(w) for w in windows}) == 3  # the window rotated every epoch
    assert all(safe.tier.item_dir(i).is_dir() for w in windows for i in w)  # every window came from the tier


def test_the_benchmark_runs_at_toy_size_and_writes_what_its_table_says(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    toy = ["--cases", "4", "--shape", "40", "40", "24", "--patch", "16", "16", "16", "--window", "2", "--repeats", "1"]
    out = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "smartcache_tier.py"), "--out", str(tmp_path), *toy],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MONAI_FAST_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(next(tmp_path.glob("smartcache_tier_*.json")).read_text())
    assert doc["window_ram_mib"]["tier"] == 0 < doc["window_ram_mib"]["ram"]
    assert f"window {doc['window_ram_mib']['tier']:.1f} MiB in RAM" in out.stdout
    assert {r["variant"] for r in doc["rows"]} == {"ram", "tier"}
    assert all(e["crops"] == 2 * 4 for run in doc["runs"] for e in run["epochs"])  # the window's 2 items x 4 crops


def test_a_tiered_smartcache_keeps_its_tier_when_adopted_for_a_ranks_share(files, tmp_path):
    built = SafeSmartCacheDataset(files, _chain(), 0.5, cache_num=2, shuffle=False, progress=False, cache_dir=tmp_path)
    share = SafeSmartCacheDataset.adopt(built, data=files[::2], cache_num=1)
    assert share.tier is not None and share.tier.cache_dir == tmp_path and window_bytes(share) == 0
    built.shutdown()
    share.shutdown()


def test_a_window_whose_data_set_would_not_fit_the_disk_budget_stays_in_ram(files, tmp_path):
    # the tier writes every item over the rotations: where they cannot all fit, the window stays as MONAI keeps it
    user = SmartCacheDataset(files, _chain(), replace_rate=0.5, cache_num=2, shuffle=False, progress=False)
    window = window_bytes(user)
    kept = adopt_loader(
        DataLoader(user, batch_size=1),
        "cpu",
        cache="disk",
        cache_dir=tmp_path / "tier",
        ram_budget_mib=window / 2 / 2**20,
        disk_budget_mib=window / 2**20,  # room for the window, not for the data set
    )
    assert kept.dataset.tier is None and "tier" not in kept.notes[0]
    kept.dataset.shutdown()


def test_cache_disk_takes_the_tier_only_for_a_chain_that_crops_by_the_patch(files, tmp_path):
    from monai.transforms import RandGaussianNoised

    keys = ["image", "label"]
    chain = Compose([LoadImaged(keys), EnsureChannelFirstd(keys), RandGaussianNoised("image", prob=1.0)])
    user = SmartCacheDataset(files, chain, replace_rate=0.5, cache_num=2, shuffle=False, progress=False)
    kept = adopt_loader(DataLoader(user, batch_size=1), "cpu", cache="disk", cache_dir=tmp_path / "tier")
    assert kept.dataset.tier is None and window_bytes(kept.dataset) > 0
    kept.dataset.shutdown()
