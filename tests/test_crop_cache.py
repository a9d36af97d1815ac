"""CropCacheDataset on real NIfTI files and MONAI chains: the same items as MONAI's CacheDataset, read by the patch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from monai.data import CacheDataset, DataLoader, MetaTensor
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandCropByLabelClassesd,
    RandCropByPosNegLabeld,
    RandFlipd,
    RandSpatialCropd,
    ScaleIntensityRanged,
)

from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.data.crop_cache import CropCacheDataset
from monai_fast.files import tmp_path_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = generate_msd(tmp_path_factory.mktemp("msd"), "spleen-like", num_cases=4, shape=(40, 36, 24), progress=False)
    train, val = load_msd_datalist(root, val_fraction=0.25, seed=0)
    return train + val


def _chain(crop: str = "posneg", a_max: float = 240.0, flip: bool = True) -> Compose:
    keys = ["image", "label"]
    crops = {
        "posneg": RandCropByPosNegLabeld(keys, "label", (16, 16, 16), pos=2, neg=1, num_samples=3, image_key="image"),
        "classes": RandCropByLabelClassesd(keys, "label", (16, 16, 16), num_classes=2, num_samples=2),
        "spatial": RandSpatialCropd(keys, (16, 12, 8), random_size=False),
    }
    chain = [
        LoadImaged(keys),
        EnsureChannelFirstd(keys),
        Orientationd(keys, axcodes="RAS"),
        ScaleIntensityRanged("image", a_min=-57, a_max=a_max, b_min=0.0, b_max=1.0, clip=True),
        crops[crop],
    ]
    if flip:
        chain.append(RandFlipd(keys, prob=0.5, spatial_axis=0))
    return Compose(chain).set_random_state(seed=7)


def _samples(out) -> list[dict]:
    return out if isinstance(out, list) else [out]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in ("image", "label"):
        assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
        assert isinstance(b[key], MetaTensor)
        assert torch.equal(a[key].affine, b[key].affine)
        assert [op["class"] for op in a[key].applied_operations] == [op["class"] for op in b[key].applied_operations]
        assert a[key].meta["filename_or_obj"] == b[key].meta["filename_or_obj"]


@pytest.mark.parametrize("crop", ["posneg", "classes", "spatial"])
def test_the_items_are_monais_over_two_epochs_written_and_read_back(files, tmp_path, crop):
    reference = CacheDataset(files, _chain(crop), progress=False)
    ours = CropCacheDataset(files, _chain(crop), tmp_path / "cache")
    for ds in (reference, ours):  # CacheDataset's flatten() reseeded its chain: both start from one state
        ds.transform.set_random_state(seed=7)
    assert ours.reads_patches
    for _ in range(2):  # the first epoch writes, the second reads the files
        for i in range(len(files)):
            a, b = _samples(reference[i]), _samples(ours[i])
            assert len(a) == len(b)
            for x, y in zip(a, b):
                _same(x, y)
    folders = sorted(p for p in (tmp_path / "cache").iterdir())
    assert len(folders) == len(files)
    for folder in folders:  # raw arrays and JSON, nothing pickled
        names = {p.suffix for p in folder.iterdir()}
        assert names <= {".npy", ".json"}, names
        for npy in folder.glob("*.npy"):
            np.load(npy, allow_pickle=False)


def _mapped_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``), ``None`` for anonymous memory or heap."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= address < hi:
            return parts[5] if len(parts) == 6 and parts[5].startswith("/") else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_a_crop_is_a_view_of_the_mapped_volume_not_a_copy(files, tmp_path):
    ds = CropCacheDataset(files, _chain("posneg", flip=False), tmp_path / "cache")
    ds.fill()
    patch = ds[0][0]["image"]
    assert patch.shape == (1, 16, 16, 16) and not patch.is_contiguous()
    # the patch's memory is the item's file mapped, so a step reads the pages of its patch only
    assert _mapped_file(patch.data_ptr()) == str(ds.item_dir(0) / "a0.npy")
    # MONAI's CacheDataset holds the volume in anonymous memory, the control for the check itself
    reference = CacheDataset(files, _chain("posneg", flip=False), progress=False)[0][0]["image"]
    assert _mapped_file(reference.data_ptr()) is None


def test_the_key_follows_the_transforms_parameters_and_the_files(files, tmp_path):
    cache = tmp_path / "cache"
    a = CropCacheDataset(files, _chain(a_max=240.0), cache)
    b = CropCacheDataset(files, _chain(a_max=200.0), cache)
    assert a.item_dir(0) != b.item_dir(0)
    assert CropCacheDataset(files, _chain(a_max=240.0), cache).item_dir(0) == a.item_dir(0)
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    moved = []
    for item in files[:1]:
        new = {}
        for key in ("image", "label"):
            dst = copy_dir / Path(item[key]).name
            dst.write_bytes(Path(item[key]).read_bytes())
            new[key] = str(dst)
        moved.append(new)
    before = CropCacheDataset(moved, _chain(), cache).item_dir(0)
    Path(moved[0]["image"]).write_bytes(Path(files[1]["image"]).read_bytes())  # overwritten in place
    assert CropCacheDataset(moved, _chain(), cache).item_dir(0) != before


def test_a_damaged_item_is_rebuilt_not_trained_on(files, tmp_path, caplog):
    ds = CropCacheDataset(files, _chain(flip=False), tmp_path / "cache")
    ds.fill()
    npy = ds.item_dir(1) / "a0.npy"
    npy.write_bytes(npy.read_bytes()[:100])
    reference = CacheDataset(files, _chain(flip=False), progress=False)
    fresh = CropCacheDataset(files, _chain(flip=False), tmp_path / "cache")
    for d in (reference, fresh):
        d.transform.set_random_state(seed=7)
    for i in range(len(files)):
        for x, y in zip(_samples(reference[i]), _samples(fresh[i])):
            _same(x, y)
    assert any("damaged" in r.getMessage() and str(ds.item_dir(1)) in r.getMessage() for r in caplog.records)


_WRITER = """
import sys
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandCropByPosNegLabeld
from monai_fast.data.crop_cache import CropCacheDataset
files = {files!r}
keys = ["image", "label"]
chain = Compose([LoadImaged(keys), EnsureChannelFirstd(keys), RandCropByPosNegLabeld(keys, "label", (8, 8, 8))])
ds = CropCacheDataset(files, chain, {cache!r})
print("wrote", ds.fill())
"""


def test_concurrent_writers_leave_whole_items_and_a_killed_writers_folder_is_cleaned(files, tmp_path):
    cache = tmp_path / "cache"
    code = _WRITER.format(files=files, cache=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(int(o.split()[-1]) for o in outs) >= len(files)  # every item written at least once, by someone
    folders = [p for p in cache.iterdir()]
    assert len(folders) == len(files), folders  # no temporary folder left, no item twice
    for folder in folders:
        record = json.loads((folder / "item.json").read_text())
        assert {"image", "label"} <= record["keys"].keys() and record["indices"]
    # a writer killed mid-item leaves its temporary folder; the next data set removes it
    leftover = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                from monai_fast.files import tmp_path_for
                p = tmp_path_for({str(cache / "someitem")!r}); p.mkdir(); (p / "a0.npy").write_bytes(b"half")
                print(p)
            """),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(leftover).is_dir()
    CropCacheDataset(files, _chain(), cache)
    assert not Path(leftover).exists()
    assert tmp_path_for(cache / "x").parent == cache


def test_loader_workers_read_the_same_items(files, tmp_path):
    ds = CropCacheDataset(files, _chain(flip=False), tmp_path / "cache")
    ds.fill()
    batches = list(DataLoader(ds, batch_size=2, num_workers=2))
    assert sum(b["image"].shape[0] for b in batches) == len(files) * 3
    assert all(b["image"].shape[1:] == (1, 16, 16, 16) for b in batches)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="identity must be"):
        CropCacheDataset([], _chain(), "/tmp/x", identity="mtime")
    with pytest.raises(ValueError, match="cache_dir is required"):
        CropCacheDataset([], _chain(), "")


class _InterruptedPath(os.PathLike):
    """An item's value whose path, read as the item is written into its folder, raises as Ctrl-C would there."""

    def __fspath__(self) -> str:
        if sys._getframe(1).f_code.co_name == "_encode":  # the item's record, after its arrays are saved
            raise KeyboardInterrupt
        return "/nonexistent/note"


def test_an_interrupt_while_an_item_is_written_leaves_no_partial_folder(files, tmp_path):
    ds = CropCacheDataset([{**files[0], "note": _InterruptedPath()}], _chain(), tmp_path / "cache")
    with pytest.raises(KeyboardInterrupt):
        ds[0]
    assert not list((tmp_path / "cache").rglob("*.tmp")), "a half-written item is left in this live process's name"
