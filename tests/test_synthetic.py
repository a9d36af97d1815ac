import json

import nibabel as nib
import numpy as np
import pytest

from monai_fast.apps.sources import synthetic
from monai_fast.apps.sources.synthetic import generate_msd


def _arrays(root, name):
    img = nib.load(root / "imagesTr" / name)
    lab = nib.load(root / "labelsTr" / name)
    return np.asanyarray(img.dataobj), np.asanyarray(lab.dataobj), img.affine


def test_spleen_like_layout_and_content(tmp_path):
    root = generate_msd(tmp_path / "s", "spleen-like", num_cases=3, shape=(40, 36, 24), progress=False)
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["numTraining"] == 3 and len(meta["training"]) == 3
    assert meta["modality"] == {"0": "CT"} and meta["labels"]["1"] == "spleen"
    assert meta["tensorImageSize"] == "3D"
    first = meta["training"][0]
    assert first["image"].startswith("./imagesTr/") and first["label"].startswith("./labelsTr/")
    name = first["image"].split("/")[-1]
    img, lab, affine = _arrays(root, name)
    assert img.shape == lab.shape == (40, 36, 24)
    assert img.dtype == np.int16 and lab.dtype == np.uint8
    assert img.min() >= -1024 and img.max() <= 3071
    assert set(np.unique(lab)) == {0, 1}
    # non-unit, LPS-like spacing, so Orientationd and Spacingd have work to do
    np.testing.assert_allclose(np.abs(np.diag(affine)[:3]), [1.6, 1.6, 2.5], rtol=1e-6)
    assert affine[0, 0] < 0 and affine[1, 1] < 0
    # the organ is brighter than the soft tissue around it
    assert img[lab == 1].mean() > img[(lab == 0) & (img > 0) & (img < 200)].mean() + 40


def test_same_seed_same_data_and_cases_independent_of_count(tmp_path):
    a = generate_msd(tmp_path / "a", num_cases=2, shape=(32, 32, 16), seed=3, progress=False)
    b = generate_msd(tmp_path / "b", num_cases=3, shape=(32, 32, 16), seed=3, progress=False)
    c = generate_msd(tmp_path / "c", num_cases=2, shape=(32, 32, 16), seed=4, progress=False)
    for name in ("spleen_001.nii.gz", "spleen_002.nii.gz"):
        ia, la, _ = _arrays(a, name)
        ib, lb, _ = _arrays(b, name)
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(la, lb)
    assert not np.array_equal(_arrays(a, "spleen_001.nii.gz")[0], _arrays(c, "spleen_001.nii.gz")[0])


def test_brats_like_four_channels_and_nested_regions(tmp_path):
    root = generate_msd(tmp_path / "b", "brats-like", num_cases=2, shape=(48, 48, 48), progress=False)
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["tensorImageSize"] == "4D" and len(meta["modality"]) == 4
    assert set(meta["labels"]) == {"0", "1", "2", "3"}
    img, lab, _ = _arrays(root, "BRATS_001.nii.gz")
    assert img.shape == (48, 48, 48, 4) and lab.shape == (48, 48, 48)
    whole, core, enh = lab > 0, lab >= 2, lab == 3
    assert whole.sum() > core.sum() > enh.sum() > 0

    # nesting: the tumour core lies inside the whole tumour's bounding box, the enhancing part inside the core's
    def box(m):
        idx = np.argwhere(m)
        return idx.min(0), idx.max(0)

    (w0, w1), (c0, c1), (e0, e1) = box(whole), box(core), box(enh)
    assert (w0 <= c0).all() and (c1 <= w1).all() and (c0 <= e0).all() and (e1 <= c1).all()
    # enhancing tumour is brightest on T1gd (channel 2)
    assert img[..., 2][enh].mean() > img[..., 2][lab == 1].mean()


def test_interrupted_generation_leaves_no_dataset_json(tmp_path, monkeypatch):
    real = synthetic._save_atomic
    calls = {"n": 0}

    def failing(array, affine, path):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        real(array, affine, path)

    monkeypatch.setattr(synthetic, "_save_atomic", failing)
    with pytest.raises(OSError, match="disk full"):
        generate_msd(tmp_path / "x", num_cases=3, shape=(16, 16, 16), progress=False)
    assert not (tmp_path / "x" / "dataset.json").exists()
    assert not list((tmp_path / "x").rglob(".tmp_*"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": "liver"}, "kind"),
        ({"num_cases": 0}, "num_cases"),
        ({"shape": (4, 32, 32)}, "shape"),
        ({"spacing": (1.0, 0.0, 1.0)}, "spacing"),
    ],
)
def test_bad_options_name_the_option(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_msd(tmp_path / "y", progress=False, **kwargs)


def test_spacing_really_resamples(tiny_spleen, tiny_config):
    from monai.transforms import Compose

    from monai_fast.apps.recipes.transforms import deterministic_transforms

    chain = Compose(deterministic_transforms(tiny_config)[:4])  # up to Spacingd
    item = json.loads((tiny_spleen / "dataset.json").read_text())["training"][0]
    out = chain({"image": str(tiny_spleen / item["image"]), "label": str(tiny_spleen / item["label"])})
    # 48 x 1.6 / 1.5 = 51.2 and 32 x 2.5 / 2.0 = 40 voxels
    assert tuple(out["image"].shape[1:]) == (51, 51, 40)
    np.testing.assert_allclose(out["image"].pixdim.tolist(), [1.5, 1.5, 2.0], rtol=1e-5)


def test_written_files_follow_the_umask_not_0600(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        root = generate_msd(tmp_path / "d", "spleen-like", num_cases=1, shape=(16, 16, 8), progress=False)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in root.rglob("*") if p.is_file()}
    assert modes and set(modes.values()) == {0o644}, modes
