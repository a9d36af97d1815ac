"""Adoption never changes what a data set yields, and a failing item is named the same in every loader path.

* A ``Dataset`` subclass with its own ``__getitem__`` / ``_transform`` (a key added per item) is not
  rebuilt from ``.data`` / ``.transform``: ``FastTraining`` leaves the data lever alone and says
  why, so the added key still reaches the batches.
* An item that fails in a ``SafeThreadDataLoader`` worker process is named by index and files,
  with the same message as in the loader thread.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from monai.data import CacheDataset, DataLoader, Dataset, list_data_collate
from monai.engines import SupervisedTrainer
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, Resized
from torch.utils.data import DistributedSampler

from monai_fast.data.adopt import adopt_loader, unknown_item_path, why_not_adoptable
from monai_fast.data.items import DataItemError
from monai_fast.data.loaders import SafeThreadDataLoader
from monai_fast.handlers import FastTraining

KEYS = ["image", "label"]


def _chain():
    return Compose([LoadImaged(keys=KEYS), EnsureChannelFirstd(keys=KEYS), Resized(keys=KEYS, spatial_size=(8, 8, 8))])


class WithCaseId(Dataset):
    """A user's data set that adds a key in ``__getitem__``: the item path is its own."""

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return {**item, "case": torch.tensor(index)}


class ScaledInTransform(CacheDataset):
    """A cache whose ``_transform`` scales the image after MONAI's chain."""

    def _transform(self, index):
        item = super()._transform(index)
        return {**item, "image": item["image"] * 0 + 7}


def _trainer(loader, keys_seen):
    net = torch.nn.Conv3d(1, 1, 1)
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=loader,
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.0),
        loss_function=lambda p, y: (p - y.float()).abs().mean(),
        decollate=False,
    )
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: keys_seen.append(set(e.state.batch)))
    return trainer


def test_a_subclass_adding_a_key_in_getitem_is_left_alone_and_the_key_reaches_the_batches(tiny_files, caplog):
    train, _ = tiny_files
    ds = WithCaseId(train, _chain())
    keys_seen = []
    trainer = _trainer(DataLoader(ds, batch_size=2, shuffle=True, collate_fn=list_data_collate), keys_seen)
    fast = FastTraining(precision=False, memory_format=False, prefetch=False, evaluator=False)
    with caplog.at_level(logging.INFO, logger="monai_fast"):
        fast.attach(trainer)
    row = fast.applied["data"]
    assert not row["applied"]
    assert "class WithCaseId has its own __getitem__ (WithCaseId.__getitem__)" in row["reason"]
    logged = [r.getMessage() for r in caplog.records]
    assert any("FastTraining data: left alone: the data set's class WithCaseId" in line for line in logged)
    assert trainer.data_loader.dataset is ds
    trainer.run()
    assert keys_seen and all("case" in keys for keys in keys_seen)  # the override's key reaches every batch


def test_a_cache_subclass_with_its_own_transform_is_not_rebuilt_under_a_distributed_sampler(tiny_files):
    # a kept cache keeps its own item path; a DistributedSampler would rebuild it per rank from .data: refused
    train, _ = tiny_files
    ds = ScaledInTransform(train, _chain(), progress=False)
    kept = DataLoader(ds, batch_size=1)
    assert why_not_adoptable(kept) is None and adopt_loader(kept).dataset is ds
    sharded = DataLoader(ds, batch_size=1, sampler=DistributedSampler(ds, num_replicas=2, rank=0))
    why = why_not_adoptable(sharded)
    assert why is not None and "ScaledInTransform._transform" in why
    with pytest.raises(ValueError, match=r"ScaledInTransform has its own _transform"):
        adopt_loader(sharded)


def test_monais_own_classes_and_a_subclass_that_only_sets_defaults_are_adoptable(tiny_files):
    class Defaults(CacheDataset):
        def __init__(self, data, transform):
            super().__init__(data, transform, progress=False, num_workers=1)

    train, _ = tiny_files
    kinds = (Dataset(train, _chain()), CacheDataset(train[:1], _chain(), progress=False), Defaults(train[:1], _chain()))
    for ds in kinds:
        assert unknown_item_path(ds) is None


def _bad_files(tiny_files, tmp_path):
    train, val = tiny_files
    files = [dict(d) for d in (train + val)[:5]]
    bad = tmp_path / "spleen_truncated.nii.gz"
    bad.write_bytes(Path(files[3]["image"]).read_bytes()[:200])
    files[3]["image"] = str(bad)
    return files


def _failure(loader):
    with pytest.raises(DataItemError) as info:
        for _ in loader:
            pass
    return info.value


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_failing_item_in_a_worker_process_is_named_as_in_the_loader_thread(tiny_files, tmp_path, batch_size):
    ds = Dataset(_bad_files(tiny_files, tmp_path), _chain())
    in_thread = _failure(SafeThreadDataLoader(ds, batch_size=batch_size, num_workers=0))
    in_worker = _failure(SafeThreadDataLoader(ds, batch_size=batch_size, num_workers=2))
    same = lambda text: re.sub(r" at 0x[0-9a-f]+", "", text)  # noqa: E731  (object addresses differ per process)
    assert str(in_worker).startswith(r"loading item 3 (image=") and "spleen_truncated.nii.gz, label=" in str(in_worker)
    assert same(str(in_worker)) == same(str(in_thread))
    assert "Original Traceback" in str(in_worker.__cause__)  # the worker's own traceback is kept as the cause
