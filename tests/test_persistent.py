import shutil
import time
import warnings

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, ScaleIntensityRanged

from monai_fast.data.persistent import TrustedPersistentDataset, transform_fingerprint


def _chain(a_max=164.0):
    return Compose(
        [
            LoadImaged(keys=["image", "label"]),
            EnsureChannelFirstd(keys=["image", "label"]),
            ScaleIntensityRanged(keys="image", a_min=-57, a_max=a_max, b_min=0, b_max=1, clip=True),
        ]
    )


@pytest.fixture
def one_case(tiny_files, tmp_path):
    src = tiny_files[0][0]
    dst = {"image": str(tmp_path / "img.nii.gz"), "label": str(tmp_path / "lab.nii.gz")}
    shutil.copy(src["image"], dst["image"])
    shutil.copy(src["label"], dst["label"])
    return dst


def _pt_files(d):
    return sorted(p for p in d.glob("*.pt"))


def test_caches_once_and_reads_back_equal(one_case, tmp_path):
    cache = tmp_path / "cache"
    first = TrustedPersistentDataset([one_case], _chain(), cache)[0]
    (f,) = _pt_files(cache)
    stamp = f.stat().st_mtime_ns
    again = TrustedPersistentDataset([one_case], _chain(), cache)[0]
    assert f.stat().st_mtime_ns == stamp  # a hit: not rewritten
    assert torch.allclose(torch.as_tensor(first["image"]), torch.as_tensor(again["image"]))
    assert not list(cache.glob(".*tmp"))


def test_a_file_replaced_at_the_same_path_gets_a_new_key(one_case, tmp_path):
    cache = tmp_path / "cache"
    old = TrustedPersistentDataset([one_case], _chain(), cache)[0]
    img = nib.load(one_case["image"])
    data = np.asanyarray(img.dataobj).astype(np.int16) + 100  # a different scan, same path
    time.sleep(0.01)
    nib.save(nib.Nifti1Image(data, img.affine), one_case["image"])
    new = TrustedPersistentDataset([one_case], _chain(), cache)[0]
    assert len(_pt_files(cache)) == 2
    assert not torch.allclose(torch.as_tensor(old["image"]), torch.as_tensor(new["image"]))


def test_content_identity_survives_a_touch(one_case, tmp_path):
    cache = tmp_path / "cache"
    TrustedPersistentDataset([one_case], _chain(), cache, identity="content")[0]
    import os

    os.utime(one_case["image"], ns=(1, 1))  # same bytes, new mtime
    TrustedPersistentDataset([one_case], _chain(), cache, identity="content")[0]
    assert len(_pt_files(cache)) == 1


def test_changed_transform_parameters_change_the_key(one_case, tmp_path):
    cache = tmp_path / "cache"
    TrustedPersistentDataset([one_case], _chain(164.0), cache)[0]
    TrustedPersistentDataset([one_case], _chain(300.0), cache)[0]
    assert len(_pt_files(cache)) == 2
    assert transform_fingerprint(_chain(1.0).transforms) == transform_fingerprint(_chain(1.0).transforms)
    assert transform_fingerprint(_chain(1.0).transforms) != transform_fingerprint(_chain(2.0).transforms)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_cache_file_is_rebuilt_with_a_warning(one_case, tmp_path, damage):
    cache = tmp_path / "cache"
    good = TrustedPersistentDataset([one_case], _chain(), cache)[0]
    (f,) = _pt_files(cache)
    raw = f.read_bytes()
    f.write_bytes({"truncate": raw[: len(raw) // 3], "garbage": b"\x00not a torch file" * 10, "empty": b""}[damage])
    with pytest.warns(UserWarning, match="damaged"):
        rebuilt = TrustedPersistentDataset([one_case], _chain(), cache)[0]
    assert torch.allclose(torch.as_tensor(good["image"]), torch.as_tensor(rebuilt["image"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrustedPersistentDataset([one_case], _chain(), cache)[0]  # healthy again: no warning


def test_a_failed_write_leaves_nothing_behind(one_case, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def boom(*a, **k):
        raise OSError("no space left on device")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="no space"):
        TrustedPersistentDataset([one_case], _chain(), cache)[0]
    assert list(cache.iterdir()) == []


def test_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="identity"):
        TrustedPersistentDataset([], _chain(), tmp_path, identity="md5")
    with pytest.raises(ValueError, match="hash_func"):
        TrustedPersistentDataset([], _chain(), tmp_path, hash_func=str)


def test_monai_pickle_options_are_honoured(one_case, tmp_path):
    import pickle

    cache = tmp_path / "cache"
    TrustedPersistentDataset([one_case], _chain(), cache, pickle_protocol=2)[0]
    (f,) = _pt_files(cache)
    import zipfile

    with zipfile.ZipFile(f) as z:  # torch's zip container holds the pickle written with our protocol
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert data[:2] == b"\x80\x02" and pickle.HIGHEST_PROTOCOL > 2
