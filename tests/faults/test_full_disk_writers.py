"""Writers on a full file system, and a checkpoint folder replaced by a file in the middle of a run.

Real parts: small tmpfs file systems mounted for the test (root only; skipped with the reason
otherwise), real NIfTI files written with nibabel, MONAI's data loader over the disk cache, MONAI
``SupervisedTrainer`` runs with ``Preemption`` checkpoints, and the ``monai-fast`` command run as a
subprocess.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from ignite.engine import Events
from monai.data import DataLoader
from monai.engines import SupervisedTrainer
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, ScaleIntensityd

from monai_fast.data.persistent import TrustedPersistentDataset
from monai_fast.files import NoSpaceError, free_bytes
from monai_fast.handlers import Preemption
from monai_fast.handlers.checkpoint_folder import CheckpointFolderError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_fs(tmpfs):
    """``small_fs("1M")``: a real tmpfs of that size (the ``tmpfs`` fixture of ``tests/conftest.py``)."""
    return lambda size="1M", name="small": tmpfs(f"size={size}", name)


def _fill(folder: Path, leave: int) -> None:
    """Fill ``folder``'s file system, leaving about ``leave`` bytes free (another writer took the space)."""
    take = free_bytes(folder) - leave
    if take > 0:
        with open(folder / "filler.bin", "wb") as f:
            f.write(b"\0" * take)


# ------------------------------------------------------------------ the disk cache
def _cases(folder: Path, n: int, size: int = 32) -> list[dict]:
    rng = np.random.default_rng(0)
    items = []
    for i in range(n):
        image, label = folder / f"img{i}.nii.gz", folder / f"lab{i}.nii.gz"
        nib.save(nib.Nifti1Image(rng.normal(size=(size,) * 3).astype(np.float32), np.eye(4)), image)
        nib.save(nib.Nifti1Image((rng.random((size,) * 3) > 0.5).astype(np.uint8), np.eye(4)), label)
        items.append({"image": str(image), "label": str(label)})
    return items


def _chain() -> Compose:
    return Compose(
        [
            LoadImaged(keys=["image", "label"]),
            EnsureChannelFirstd(keys=["image", "label"]),
            ScaleIntensityd(keys="image"),
        ]
    )


def test_a_full_disk_cache_warns_once_and_training_data_stay_right(small_fs, tmp_path, caplog):
    cache = small_fs("1M") / "cache"
    items = _cases(tmp_path, 8)  # ~265 KiB cached per item: about 3 fit
    ds = TrustedPersistentDataset(items, _chain(), cache)
    expected = [_chain()(dict(it)) for it in items]
    with caplog.at_level(logging.WARNING, logger="monai_fast.data"):
        for _ in range(2):  # two epochs: the second reads the items that fit, computes the rest
            for i, batch in enumerate(DataLoader(ds, batch_size=1, num_workers=0)):
                assert torch.equal(torch.as_tensor(batch["image"][0]), torch.as_tensor(expected[i]["image"]))
                assert torch.equal(torch.as_tensor(batch["label"][0]), torch.as_tensor(expected[i]["label"]))
    full = [r.getMessage() for r in caplog.records if "no space" in r.getMessage()]
    assert len(full) == 1, full  # one warning, not one per item
    assert str(cache) in full[0] and "missing" in full[0] and "computed in memory" in full[0]
    assert isinstance(ds.disk_full, NoSpaceError) and ds.disk_full.needed > ds.disk_full.free
    assert not [p for p in cache.iterdir() if p.suffix != ".pt"]  # no temporary file left
    written = sorted(cache.glob("*.pt"))
    assert 1 <= len(written) < len(items)
    for p in written:  # every file under a final name is whole
        torch.load(p, weights_only=False)


def test_a_full_crop_cache_folder_warns_once_and_the_crops_stay_the_ones_monai_draws(small_fs, tmp_path, caplog):
    """The crop-reading tier on a real 1 MiB file system: the items that fit are written whole, the rest computed in
    memory, one warning naming the folder, and every epoch's crops equal MONAI's own from the same random state."""
    from monai.data import Dataset
    from monai.transforms import RandSpatialCropd

    from monai_fast.data.crop_cache import CropCacheDataset

    def chain() -> Compose:
        crop = RandSpatialCropd(keys=["image", "label"], roi_size=(16, 16, 16), random_size=False)
        return Compose([*_chain().transforms, crop]).set_random_state(seed=7)

    cache = small_fs("1M") / "crops"
    items = _cases(tmp_path, 8)  # about 265 KiB an item: about 3 fit
    mine, monai = CropCacheDataset(items, chain(), cache_dir=cache), Dataset(items, chain())
    with caplog.at_level(logging.WARNING, logger="monai_fast.data"):
        for _ in range(2):
            for i in range(len(items)):
                got, want = mine[i], monai[i]
                assert torch.equal(torch.as_tensor(got["image"]), torch.as_tensor(want["image"])), i
                assert torch.equal(torch.as_tensor(got["label"]), torch.as_tensor(want["label"])), i
    full = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert len(full) == 1 and str(cache) in full[0] and "computed in memory" in full[0], full
    assert "No space left on device" in full[0] and "None" not in full[0], full
    whole = [p for p in cache.iterdir() if (p / "item.json").exists()]
    assert 1 <= len(whole) < len(items) and len(whole) == len(list(cache.iterdir()))  # nothing half-written


def test_a_full_disk_cache_in_loader_workers_still_delivers_every_item(small_fs, tmp_path):
    cache = small_fs("1M") / "cache"
    items = _cases(tmp_path, 8)
    ds = TrustedPersistentDataset(items, _chain(), cache)
    got = [torch.as_tensor(b["image"][0]) for b in DataLoader(ds, batch_size=1, num_workers=2)]
    assert len(got) == len(items)
    for g, it in zip(got, items):
        assert torch.equal(g, torch.as_tensor(_chain()(dict(it))["image"]))
    for p in cache.glob("*.pt"):
        torch.load(p, weights_only=False)
    assert not list(cache.glob(".*.tmp"))


# ------------------------------------------------------------------ checkpoints
def _trainer(net: torch.nn.Module) -> SupervisedTrainer:
    data = [{"image": torch.randn(2, 256), "label": torch.randn(2, 256)} for _ in range(8)]
    return SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=2,
        train_data_loader=data,
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        loss_function=torch.nn.MSELoss(),
    )


def test_a_checkpoint_on_a_full_disk_stops_the_run_and_keeps_the_earlier_ones(small_fs, caplog):
    folder = small_fs("2M") / "ckpt"
    net = torch.nn.Linear(256, 256)  # a checkpoint of about 260 KiB
    trainer = _trainer(net)
    pre = Preemption({"trainer": trainer, "model": net}, folder, save_every=2, n_saved=2)
    pre.attach(trainer)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=5), lambda e: _fill(folder.parent, 64 * 1024))
    with pytest.raises(NoSpaceError) as info:
        trainer.run()
    text = str(info.value)
    assert "ckpt-000000006.pt" in text and str(folder) in text and "missing" in text
    assert "ckpt-000000004.pt" in text and "ckpt-000000002.pt" in text  # what is kept, named
    assert trainer.state.iteration == 6  # the run stopped at the failed checkpoint
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt-000000002.pt", "ckpt-000000004.pt"]
    (folder.parent / "filler.bin").unlink()
    again = _trainer(torch.nn.Linear(256, 256))
    resumed = Preemption({"trainer": again, "model": again.network}, folder)
    resumed.attach(again)
    assert resumed.resume() == 4  # the kept checkpoint loads


def test_a_checkpoint_folder_replaced_by_a_file_stops_the_run_naming_it(tmp_path):
    folder = tmp_path / "ckpt"
    net = torch.nn.Linear(256, 256)
    trainer = _trainer(net)
    pre = Preemption({"trainer": trainer, "model": net}, folder, save_every=2, n_saved=2)
    pre.attach(trainer)

    def replace(_):
        folder.rename(tmp_path / "moved")
        folder.write_text("not a folder")

    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=5), replace)
    with pytest.raises(CheckpointFolderError) as info:
        trainer.run()
    text = str(info.value)
    assert str(folder) in text and "no longer a folder" in text and "ckpt-000000006.pt" in text
    assert "ckpt-000000004.pt" in text  # the last one written, named
    assert info.value.filename == str(folder)
    assert trainer.state.iteration == 6
    assert folder.read_text() == "not a folder"  # the file that replaced it is left alone
    moved = sorted(p.name for p in (tmp_path / "moved").iterdir())
    assert moved == ["ckpt-000000002.pt", "ckpt-000000004.pt"]
    state = torch.load(tmp_path / "moved" / "ckpt-000000004.pt", weights_only=False)
    assert state["trainer"]["iteration"] == 4


# ------------------------------------------------------------------ the command line
def test_the_command_line_ends_a_full_disk_in_one_line(small_fs):
    out = small_fs("256k") / "data"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "monai_fast",
            "synth",
            str(out),
            "--cases",
            "4",
            "--shape",
            "64",
            "64",
            "64",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("monai-fast synth: ") and str(out) in last and "no space left" in last, r.stderr
    assert not (out / "dataset.json").exists()  # an incomplete data set is never marked complete
    assert not list(out.rglob(".*.tmp"))


# ------------------------------------------------------------------ profiles and tuning results
def test_a_profile_on_a_full_disk_is_named_and_training_goes_on(small_fs, caplog):
    from ignite.engine import Engine

    from monai_fast.handlers import KernelProfiler

    out = small_fs("64k")
    _fill(out, 0)
    net = torch.nn.Conv3d(1, 4, 3)
    engine = Engine(lambda e, b: net(torch.randn(2, 1, 8, 8, 8)).sum().backward())
    prof = KernelProfiler(out, wait=1, warmup=1, active=2)
    prof.attach(engine)
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        engine.run(list(range(6)), max_epochs=1)
    assert engine.state.iteration == 6  # the run went on
    said = [r.getMessage() for r in caplog.records if "profile not written" in r.getMessage()]
    assert len(said) == 1 and "trace_rank0.json" in said[0] and "no space" in said[0]
    assert prof.summary["All kernels"]["# Ops"] > 0  # kept in memory
    assert [p.name for p in out.iterdir()] == ["filler.bin"]  # nothing half-written


def test_a_tuning_result_that_cannot_be_stored_is_still_returned(small_fs, caplog):
    from monai_fast.tune import TuneStore
    from monai_fast.tune.result import TuneResult

    folder = small_fs("64k")
    store = TuneStore(folder / "tuning.json")
    store.path.write_text("{}")
    _fill(folder, 0)
    result = TuneResult(
        key="k" * 200_000,
        device="cpu",
        batch_size=2,
        sw_batch_size=4,
        val_device="cpu",
        precision="fp32",
        train_samples_per_s=1.0,
        val_volumes_per_s=1.0,
        budget_mib=1.0,
        leak_mib=0.0,
        tuning_s=1.0,
    )  # more than the disk holds
    with caplog.at_level(logging.WARNING, logger="monai_fast.tune"):
        store.put(result)
    assert any("tuning.json" in r.getMessage() and "no space" in r.getMessage() for r in caplog.records)
    assert store.path.read_text() == "{}"


def _two_ranks_checkpoint(local_rank: int, folder: str, out_dir: str) -> None:
    import json

    from ignite import distributed as idist
    from ignite.engine import Engine

    from monai_fast.handlers.checkpoint_folder import CheckpointFolder

    net = torch.nn.Linear(256, 256)
    engine = Engine(lambda e, b: None)
    ckpt = CheckpointFolder({"trainer": engine, "model": net}, folder, n_saved=2)
    engine.add_event_handler(Events.ITERATION_COMPLETED(every=2), ckpt.write)
    if idist.get_rank() == 0:  # the file system fills after the first checkpoint
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=3), lambda e: _fill(Path(folder).parent, 16 * 1024))
    try:
        engine.run(range(6), max_epochs=1)
        said = {"error": None}
    except Exception as err:  # noqa: BLE001 - what each rank saw is the test's evidence
        said = {"error": type(err).__name__, "message": str(err), "iteration": engine.state.iteration}
    Path(out_dir, f"rank{idist.get_rank()}.json").write_text(json.dumps(said))


def test_a_full_disk_under_ddp_stops_every_rank_with_the_same_error(small_fs, tmp_path):
    import json
    import time

    from monai_fast.apps.launch import run

    folder = small_fs("1M") / "ckpt"
    start = time.monotonic()
    run(_two_ranks_checkpoint, str(folder), str(tmp_path), nproc_per_node=2, timeout_s=60)
    assert time.monotonic() - start < 50  # no rank waited for the collective's timeout
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["error"] for s in said] == ["NoSpaceError", "NoSpaceError"], said  # rank 1 learns rank 0's failure
    for s in said:
        assert s["error"] == "NoSpaceError" and s["iteration"] == 4, s
        assert "ckpt-000000004.pt" in s["message"] and "ckpt-000000002.pt" in s["message"]
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt-000000002.pt"]
