import json
import shutil

import nibabel as nib
import numpy as np
import pytest

from monai_fast.apps.sources.msd import MSDDataError, case_id, load_msd_datalist


@pytest.fixture
def msd_copy(tiny_spleen, tmp_path):
    dst = tmp_path / "Task"
    shutil.copytree(tiny_spleen, dst)
    return dst


def test_split_is_fixed_by_seed_and_disjoint(tiny_spleen):
    train, val = load_msd_datalist(tiny_spleen, val_fraction=0.34, seed=0)
    again = load_msd_datalist(tiny_spleen, val_fraction=0.34, seed=0)
    assert (train, val) == again
    assert len(train) == 4 and len(val) == 2
    assert not {d["image"] for d in train} & {d["image"] for d in val}
    for d in train + val:
        assert case_id(d["image"]) == case_id(d["label"])
        assert d["image"].endswith(".nii.gz")


def test_split_changes_with_seed(tiny_spleen):
    vals = {tuple(sorted(d["image"] for d in load_msd_datalist(tiny_spleen, 0.34, seed=s)[1])) for s in range(6)}
    assert len(vals) > 1


def test_the_split_is_monais_partition_of_the_listing_in_its_order(tiny_spleen):
    from monai.data import load_decathlon_datalist, partition_dataset

    listed = load_decathlon_datalist(tiny_spleen / "dataset.json", data_list_key="training")
    train, val = load_msd_datalist(tiny_spleen, val_fraction=0.34, seed=3)
    _, val_idx = partition_dataset(range(len(listed)), ratios=[4, 2], shuffle=True, seed=3)  # what a user can redo
    assert [d["image"] for d in val] == [listed[i]["image"] for i in sorted(val_idx)]
    assert sorted(d["image"] for d in train + val) == sorted(d["image"] for d in listed)


def test_user_fold(tiny_spleen):
    train, val = load_msd_datalist(tiny_spleen, val_cases=["spleen_002", "spleen_005.nii.gz"])
    assert sorted(case_id(d["image"]) for d in val) == ["spleen_002", "spleen_005"]
    assert len(train) == 4


def test_unknown_fold_case_is_named(tiny_spleen):
    with pytest.raises(MSDDataError, match="spleen_099"):
        load_msd_datalist(tiny_spleen, val_cases=["spleen_099"])


def test_missing_dataset_json_names_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/dataset\.json"):
        load_msd_datalist(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_msd_datalist(tmp_path / "nowhere")


def test_missing_listed_file_names_path(msd_copy):
    (msd_copy / "labelsTr" / "spleen_003.nii.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"labelsTr/spleen_003\.nii\.gz"):
        load_msd_datalist(msd_copy)


def test_shape_mismatch_names_both_files(msd_copy):
    nib.save(nib.Nifti1Image(np.zeros((10, 10, 10), np.uint8), np.eye(4)), msd_copy / "labelsTr" / "spleen_004.nii.gz")
    with pytest.raises(MSDDataError, match=r"imagesTr/spleen_004\.nii\.gz.*labelsTr/spleen_004\.nii\.gz"):
        load_msd_datalist(msd_copy)


def test_malformed_json(msd_copy):
    (msd_copy / "dataset.json").write_text("{not json")
    with pytest.raises(MSDDataError, match="not valid JSON"):
        load_msd_datalist(msd_copy)
    (msd_copy / "dataset.json").write_text(json.dumps({"training": [{"image": "./imagesTr/a.nii.gz"}]}))
    with pytest.raises(MSDDataError, match=r"training\[0\]"):
        load_msd_datalist(msd_copy)


def test_four_d_brats_image_matches_3d_label(tmp_path):
    from monai_fast.apps.sources.synthetic import generate_msd

    root = generate_msd(tmp_path / "b", "brats-like", num_cases=3, shape=(24, 24, 24), progress=False)
    train, val = load_msd_datalist(root, val_fraction=0.34)
    assert len(train) + len(val) == 3


def test_an_image_listed_as_several_files_is_one_line_naming_the_entry(msd_copy):
    meta = json.loads((msd_copy / "dataset.json").read_text())
    meta["training"][1]["image"] = [meta["training"][1]["image"], meta["training"][2]["image"]]
    (msd_copy / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(MSDDataError) as info:
        load_msd_datalist(msd_copy)
    text = str(info.value)
    assert "\n" not in text and str(msd_copy / "dataset.json") in text and "training[1]['image']" in text
    assert "one file path" in text
