"""``SmartCacheUpdater().attach(trainer)`` over MONAI's ``SmartCacheDataset``: adopted, or refused where it cannot be.

Real MONAI trainers on tiny tensors, MONAI's ``SmartCacheDataset`` on real NIfTI files, ignite's
``Checkpoint``, a real notebook kernel and two real gloo ranks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import ignite.distributed as idist
import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver
from monai.data import DataLoader, SmartCacheDataset, list_data_collate
from monai.engines import SupervisedTrainer
from monai.handlers import SmartCacheHandler
from monai.transforms import Compose, EnsureChannelFirstd, Lambdad, LoadImaged, Resized
from torch.utils.data import DistributedSampler

from monai_fast.apps.launch import free_port
from monai_fast.data.items import DataItemError
from monai_fast.data.loaders import SafeThreadDataLoader
from monai_fast.data.smartcache import SafeSmartCacheDataset
from monai_fast.handlers import FastTraining, SmartCacheUpdater
from monai_fast.handlers.lifecycle import handlers_on

ROOT = Path(__file__).resolve().parents[1]
ITEMS = [{"image": f"/data/image{i}.nii.gz", "id": i} for i in range(1, 6)]
GUIDE = [[1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 1], [4, 5, 1, 2], [5, 1, 2, 3]]


class CountedUpdates(SmartCacheDataset):
    """A user's subclass with its own rotation method: never adopted."""

    calls = 0

    def update_cache(self) -> None:
        type(self).calls += 1
        super().update_cache()


def _tensors(fn=lambda x: x):
    """Items become tiny image/label tensors; ``fn`` sees the id (to fail or block on one)."""
    return Compose(
        [
            Lambdad("id", fn),
            Lambdad("image", lambda _: torch.zeros(1, 4, 4, 4)),
            Lambdad("label", lambda _: torch.zeros(1, 4, 4, 4), overwrite=True, allow_missing_keys=True),
        ]
    )


def _ds(cls=SmartCacheDataset, fn=lambda x: x, items=ITEMS, **kwargs):
    items = [{**d, "label": 0} for d in items]
    options = {"replace_rate": 0.25, "cache_num": 4, "shuffle": False, "progress": False, **kwargs}
    return cls(items, _tensors(fn), **options)


def _trainer(ds, seen, max_epochs=5, loader=None, train_handlers=None):
    """A MONAI SupervisedTrainer over ``ds`` that records the ids of each epoch's items (in the window's order)."""
    net = torch.nn.Conv3d(1, 1, 1)
    loader = loader or DataLoader(ds, batch_size=2, shuffle=False, collate_fn=list_data_collate)
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=max_epochs,
        train_data_loader=loader,
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.0),
        loss_function=lambda p, y: (p - y.float()).abs().mean(),
        train_handlers=train_handlers,
    )
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: seen.append([]))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen[-1].extend(_ids(e.state.batch)))
    return trainer


def _ids(batch):
    """The ids in a batch (MONAI's trainer decollates it into a list of items after the step)."""
    return [int(d["id"]) for d in batch] if isinstance(batch, list) else [int(i) for i in batch["id"]]


def _seen_by_monais_own_handler(make_ds, epochs=5, **loader_kwargs):
    seen = []
    ds = make_ds()
    trainer = _trainer(ds, seen, epochs, DataLoader(ds, batch_size=2, collate_fn=list_data_collate, **loader_kwargs))
    SmartCacheHandler(ds).attach(trainer)
    trainer.run()
    return seen


def test_one_attach_line_rotates_monais_smartcache_as_monais_own_handler_does(caplog):
    made = []
    counted = lambda x: made.append(x) or x  # noqa: E731
    ds = _ds(SmartCacheDataset, counted, shuffle=True, seed=3)  # shuffled with a seed: the adoption keeps that order
    made.clear()
    seen = []
    trainer = _trainer(ds, seen)
    with caplog.at_level(logging.INFO, logger="monai_fast"):
        updater = SmartCacheUpdater(timeout_s=30)
        updater.attach(trainer)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SmartCacheUpdater:")]
    assert updater.mode == "adopted" and len(lines) == 1
    assert "adopted into a SafeSmartCacheDataset" in lines[0] and made == []  # the cached window handed over
    assert isinstance(trainer.data_loader, SafeThreadDataLoader) and trainer.data_loader.batch_size == 2
    assert isinstance(updater.dataset, SafeSmartCacheDataset) and updater.dataset.data == ds.data
    assert trainer.data_loader.collate_fn is list_data_collate
    trainer.run()
    assert not updater.dataset.is_started()  # shut down at COMPLETED
    assert seen == _seen_by_monais_own_handler(lambda: _ds(shuffle=True, seed=3))


def test_a_smartcache_that_cannot_be_adopted_is_refused_in_one_line_naming_the_safe_one():
    """MONAI's own rotation cannot report a replacement error (its thread dies, ``update_cache`` polls forever):
    a data set that cannot be adopted is refused at attach, before any work, and no thread hook is installed."""
    hook = threading.excepthook
    trainer = _trainer(_ds(CountedUpdates), [], max_epochs=2)
    with pytest.raises(
        ValueError,
        match=r"^SmartCacheUpdater: MONAI's CountedUpdates cannot be adopted \(the data "
        r"set's class CountedUpdates has its own update_cache.*SafeSmartCacheDataset\.adopt\(ds\)",
    ):
        SmartCacheUpdater().attach(trainer)
    plain = Engine(lambda e, b: None)  # a plain ignite engine gets its data at run(): no loader to rebuild
    with pytest.raises(ValueError, match=r"cannot be adopted \(the engine has no data_loader.*SafeSmartCacheDataset"):
        SmartCacheUpdater(_ds()).attach(plain)
    assert SmartCacheUpdater not in handlers_on(trainer) and SmartCacheUpdater not in handlers_on(plain)
    assert threading.excepthook is hook


def _failing_nifti_files(tiny_files, tmp_path):
    train, val = tiny_files
    files = [{**d, "id": i} for i, d in enumerate((train + val)[:5], start=1)]
    bad = tmp_path / "spleen_truncated.nii.gz"
    bad.write_bytes(Path(files[4]["image"]).read_bytes()[:200])  # a truncated copy of a real file
    files[4]["image"] = str(bad)
    return files


def _nifti_chain():
    keys = ["image", "label"]
    return Compose([LoadImaged(keys=keys), EnsureChannelFirstd(keys=keys), Resized(keys=keys, spatial_size=(4, 4, 4))])


def test_a_truncated_nifti_replacement_raises_naming_the_file_instead_of_hanging(tiny_files, tmp_path):
    # MONAI's own thread dies on the truncated file and update_cache() polls forever; here the epoch's end raises
    files = _failing_nifti_files(tiny_files, tmp_path)
    ds = SmartCacheDataset(files, _nifti_chain(), replace_rate=0.25, cache_num=4, shuffle=False, progress=False)
    seen, hooks = [], []
    trainer = _trainer(ds, seen, max_epochs=3)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: hooks.append(threading.excepthook))
    hook = threading.excepthook
    updater = SmartCacheUpdater(timeout_s=60)
    updater.attach(trainer)
    assert updater.mode == "adopted"
    start = time.monotonic()
    with pytest.raises(DataItemError, match=r"SmartCache replacement of item 4 \(image=.*spleen_truncated\.nii\.gz"):
        trainer.run()
    assert time.monotonic() - start < 30 and len(seen) == 1  # the first epoch's end, not a hang
    assert not updater.dataset.is_started()
    assert hooks == [hook] and threading.excepthook is hook  # caught in the rotation's own thread, no process hook


def test_a_checkpoint_resumes_the_same_rotation(tmp_path):
    seen = []
    trainer = _trainer(_ds(), seen, max_epochs=2)
    updater = SmartCacheUpdater()
    updater.attach(trainer)  # before the Checkpoint, so an epoch-end save sees the rotated position
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED, Checkpoint({"trainer": trainer, "smartcache": updater}, DiskSaver(tmp_path), n_saved=1)
    )
    trainer.run()
    (path,) = tmp_path.glob("*.pt")

    rest = []
    trainer2 = _trainer(_ds(), rest, max_epochs=5)
    updater2 = SmartCacheUpdater()
    updater2.attach(trainer2)
    Checkpoint.load_objects({"trainer": trainer2, "smartcache": updater2}, torch.load(path, weights_only=False))
    trainer2.state.max_epochs = 5  # the checkpoint holds the first run's 2
    trainer2.run()
    assert updater.mode == updater2.mode == "adopted"
    assert seen + rest == GUIDE
    assert updater2.state_dict() == {"start_pos": 0, "updates": 5, "total": 5}


def test_a_second_run_continues_the_rotation_after_the_shutdown_at_completed():
    # MONAI's shutdown() resets its position but not its cache; the second run must still continue the rotation
    seen = []
    trainer = _trainer(_ds(), seen, max_epochs=2)
    updater = SmartCacheUpdater()
    updater.attach(trainer)
    trainer.run()
    assert not updater.dataset.is_started()
    trainer.state.max_epochs = 5
    trainer.run()
    assert seen == GUIDE and updater.state_dict()["updates"] == 5


@pytest.mark.parametrize("mode", ["adopted", "fast_training"])
def test_monais_smartcache_handler_left_in_the_script_is_taken_over_not_run_twice(mode, caplog):
    # a script written for MONAI keeps SmartCacheHandler(ds) in train_handlers and adds the attach line
    ds = _ds()
    seen = []
    trainer = _trainer(ds, seen, max_epochs=3, train_handlers=[SmartCacheHandler(ds)])
    with caplog.at_level(logging.INFO, logger="monai_fast"):
        if mode == "fast_training":
            FastTraining(precision=False, memory_format=False, prefetch=False).attach(trainer)
        else:
            SmartCacheUpdater().attach(trainer)
    assert any("MONAI's SmartCacheHandler for this data set is removed" in r.getMessage() for r in caplog.records)
    trainer.run()
    assert seen == GUIDE[:3]  # once per epoch, on the data set the loader reads
    assert not ds.is_started()  # MONAI's handler did not start the (adopted-from) data set's thread


def test_fast_training_keeps_the_users_smartcache_and_attaches_the_updater():
    ds = _ds(shuffle=True, seed=1)
    trainer = _trainer(ds, [], max_epochs=2, train_handlers=[SmartCacheHandler(ds)])
    fast = FastTraining(precision=False, memory_format=False, prefetch=False)
    fast.attach(trainer)
    row = fast.applied["data"]
    assert row["applied"] and row["setting"] == "smartcache" and "no second cache" in row["reason"]
    adopted = trainer.data_loader.dataset
    assert isinstance(adopted, SafeSmartCacheDataset) and adopted.data == ds.data and adopted.cache_num == 4
    assert handlers_on(trainer)[SmartCacheUpdater].mode == "safe"
    trainer.run()
    assert adopted.updates == 2


def test_fast_training_leaves_a_subclass_with_its_own_rotation_to_the_scripts_handler():
    ds = _ds(CountedUpdates)
    seen = []
    trainer = _trainer(ds, seen, max_epochs=3, train_handlers=[SmartCacheHandler(ds)])
    CountedUpdates.calls = 0
    fast = FastTraining(precision=False, memory_format=False, prefetch=False)
    fast.attach(trainer)
    assert trainer.data_loader.dataset is ds and "left to the script's own handlers" in fast.applied["data"]["reason"]
    assert SmartCacheUpdater not in handlers_on(trainer)
    trainer.run()
    assert seen == GUIDE[:3] and CountedUpdates.calls == 3  # MONAI's handler rotated it, as without monai-fast


# ---- two gloo ranks ---------------------------------------------------------------------------------


def _ddp_main(local_rank, out_dir):
    rank = idist.get_rank()
    results = {}
    for mode in ("adopted",):
        failing = {"on": False}

        def fn(i, failing=failing):
            if failing["on"] and rank == 1:
                raise ValueError(f"rank 1 cannot read item {i}")
            return i

        items = [{**d, "id": d["id"] + 100 * k} for k in range(2) for d in ITEMS]  # 10 items
        ds = _ds(SmartCacheDataset, fn, items=items)
        seen = []
        sampler = DistributedSampler(ds, shuffle=False)
        loader = DataLoader(ds, batch_size=1, sampler=sampler, collate_fn=list_data_collate)
        trainer = _trainer(ds, seen, max_epochs=3, loader=loader)
        updater = SmartCacheUpdater(timeout_s=30)
        updater.attach(trainer)
        failing["on"] = True  # the window is cached (per rank when adopted); the first replacement fails on rank 1
        try:
            trainer.run()
            msg = "no error"
        except RuntimeError as e:
            msg = f"{type(e).__name__}: {e}"
        results[mode] = {
            "mode": updater.mode,
            "error": msg,
            "cached": len(updater.dataset),
            "seen": seen,
            "window": sorted(int(updater.dataset[i]["id"]) for i in range(len(updater.dataset))),
        }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def test_two_gloo_ranks_fail_together_and_adoption_partitions_the_items(tmp_path):
    with idist.Parallel(backend="gloo", nproc_per_node=2, master_port=free_port(), start_method="fork") as parallel:
        parallel.run(_ddp_main, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for mode in ("adopted",):
        assert r0[mode]["mode"] == r1[mode]["mode"] == mode
        assert r1[mode]["error"].startswith("DataItemError: SmartCache replacement of item")
        assert "rank 1 cannot read" in r1[mode]["error"]
        assert "failed on another rank" in r0[mode]["error"]
        assert len(r0[mode]["seen"]) == len(r1[mode]["seen"]) == 1  # both stopped at the first epoch's end
    # adopted: each rank rotates its own partition, caching half of the 4-item window
    assert r0["adopted"]["cached"] == r1["adopted"]["cached"] == 2
    assert not set(r0["adopted"]["window"]) & set(r1["adopted"]["window"])


# ---- a real notebook kernel --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, modes",
    [("SmartCacheDataset", ["adopted", "safe"])],
)
def test_in_a_notebook_rerunning_the_attach_cell_rotates_once_per_epoch(tmp_path, cls, modes):
    """Adopted: the second attach finds the adopted rotation and replaces the first updater."""
    nbformat = pytest.importorskip("nbformat", reason="notebook tests need the dev extra")
    nbclient = pytest.importorskip("nbclient", reason="notebook tests need the dev extra")
    pytest.importorskip("ipykernel", reason="notebook tests need the dev extra")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    setup = (
        "import torch\n"
        "from monai.data import SmartCacheDataset\n"
        "from test_smartcache_monai import CountedUpdates, _ds, _trainer, _seen_by_monais_own_handler\n"
        "from monai_fast.handlers import SmartCacheUpdater\n"
        f"make = lambda: _ds({cls}, shuffle=True, seed=5)\n"
        "ds = make()\n"
        "CountedUpdates.calls = 0\n"
        "seen = []\n"
        "trainer = _trainer(ds, seen, max_epochs=4)"
    )
    attach = "updater = SmartCacheUpdater(timeout_s=60)\nupdater.attach(trainer)\nprint(updater.mode)"
    check = (
        "trainer.run()\n"
        "rotations = updater.state_dict()['updates']\n"
        "assert CountedUpdates.calls == (4 if updater.mode == 'monai' else 0), CountedUpdates.calls\n"
        "assert seen == _seen_by_monais_own_handler(make, epochs=4), seen\n"
        "assert not updater.dataset.is_started()\n"
        "print('rotated', rotations)"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (setup, attach, check)])
    spec = tmp_path / "kernels" / "monai-fast-smartcache"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "k", "language": "python"}))
    specs = KernelSpecManager(kernel_dirs=[str(spec.parent)])
    km = AsyncKernelManager(kernel_name=spec.name, kernel_spec_manager=specs)
    client = nbclient.NotebookClient(
        nb, km=km, timeout=300, startup_timeout=180, resources={"metadata": {"path": str(tmp_path)}}
    )
    # the kernel imports this module's helpers: the tests folder on its path
    path = (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", ""))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    seen_modes = []
    with client.setup_kernel(env=env, cleanup_kc=True):
        client.execute_cell(nb.cells[0], 0)
        for _ in range(2):  # the attach cell, run twice as a user re-running it
            client.execute_cell(nb.cells[1], 1)
            seen_modes.append(nb.cells[1].outputs[-1]["text"].strip())
        client.execute_cell(nb.cells[2], 2)
    assert seen_modes == modes
    assert "rotated 4" in nb.cells[2].outputs[-1]["text"]


def test_a_rerun_attach_cell_on_a_new_trainer_goes_on_with_the_users_smartcache_rotation():
    """The notebook's attach cell builds a new trainer over the user's data set and attaches again: the
    rotation goes on where the first run left it (as one longer run), found from the user's own object."""
    ds = _ds()
    seen = []
    for _ in range(2):  # the cell, run twice
        trainer = _trainer(ds, seen, max_epochs=2, train_handlers=[SmartCacheHandler(ds)])
        FastTraining(precision=False, memory_format=False, prefetch=False).attach(trainer)
        updater = handlers_on(trainer)[SmartCacheUpdater]
        trainer.run()
    assert seen == GUIDE[:4]
    assert updater.updates == 4 and updater.state_dict()["updates"] == 4  # the count, public
    rotating = SafeSmartCacheDataset.adoption_of(ds)
    assert rotating is trainer.data_loader.dataset and rotating.updates == 4 and rotating.adopted_from is ds


def test_the_updaters_rotation_count_is_public_in_both_modes():
    for cls in (SmartCacheDataset, SafeSmartCacheDataset):
        trainer = _trainer(_ds(cls), [], max_epochs=3)
        updater = SmartCacheUpdater()
        assert updater.updates == 0
        updater.attach(trainer)
        trainer.run()
        assert updater.updates == 3
