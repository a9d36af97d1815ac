"""Bad whole-slide input is one clear error naming the file, key or option at fault, before any training."""

from __future__ import annotations

import json

import pytest

from monai_fast.apps.cli import main
from monai_fast.apps.recipes.pathology import PathologyConfig, build_pathology
from monai_fast.apps.sources.wsi import WSIDataError, generate_wsi, load_wsi_datalist


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    return generate_wsi(
        tmp_path_factory.mktemp("wsi") / "set",
        num_slides=2,
        size=(256, 256),
        tile=128,
        levels=2,
        patch_size=32,
        progress=False,
    )


def _rewrite(root, tmp_path, change):
    meta = json.loads((root / "dataset.json").read_text())
    change(meta)
    out = tmp_path / "set"
    out.mkdir()
    (out / "slides").symlink_to(root / "slides")
    (out / "dataset.json").write_text(json.dumps(meta))
    return out


def test_a_folder_without_dataset_json_is_named_with_how_to_make_one(tmp_path):
    with pytest.raises(
        WSIDataError, match=r"dataset.json: cannot read the WSI data set list .*monai-fast synth --kind wsi"
    ):
        load_wsi_datalist(tmp_path)


def test_a_missing_list_or_key_is_named(small_set, tmp_path):
    root = _rewrite(small_set, tmp_path, lambda m: m.pop("validation"))
    with pytest.raises(WSIDataError, match=r"dataset.json: key 'validation' must be a non-empty list of patches"):
        load_wsi_datalist(root)
    (root / "dataset.json").write_text(
        json.dumps(
            {
                "training": [{"image": "slides/slide_001.tif", "label": [0]}],
                "validation": [{"image": "slides/slide_002.tif", "location": [0, 0], "label": [1]}],
            }
        )
    )
    with pytest.raises(WSIDataError, match=r"training\[0\] has no 'location'"):
        load_wsi_datalist(root)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("slides/slide_001.tif", r"training\[0\] must be a patch entry \(a mapping\)"),
        (
            {"image": ["slides/slide_001.tif"], "location": [0, 0], "label": [0]},
            r"training\[0\]\['image'\] must be one slide path",
        ),
    ],
)
def test_an_entry_of_the_wrong_shape_is_named(small_set, tmp_path, entry, match):
    root = _rewrite(small_set, tmp_path, lambda m: m["training"].insert(0, entry))
    with pytest.raises(WSIDataError, match=match):
        load_wsi_datalist(root)


def test_a_missing_slide_file_is_named_before_training(small_set, tmp_path):
    root = _rewrite(small_set, tmp_path, lambda m: m["validation"][0].update(image="slides/gone.tif"))
    with pytest.raises(WSIDataError, match=r"validation names slide 'slides/gone.tif', which does not exist"):
        load_wsi_datalist(root)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_slides": 1}, r"num_slides must be >= 2"),
        ({"size": (250, 256)}, r"size must be two sizes .* multiples of 16, got \(250, 256\)"),
        ({"tile": 100}, r"tile must be a multiple of 16"),
        ({"levels": 6}, r"levels must be 1..8 and leave the smallest level >= 16 pixels"),
        ({"patch_size": 128}, r"patch_size must be between 8 and a quarter of the slide \(64\)"),
    ],
)
def test_a_bad_generator_option_is_named(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_wsi(tmp_path, **{"num_slides": 2, "size": (256, 256), "patch_size": 32, "progress": False, **kwargs})
    assert not (tmp_path / "dataset.json").exists()


def test_synth_names_a_wrong_shape_for_the_kind(tmp_path):
    with pytest.raises(SystemExit, match=r"--shape: --kind wsi takes 2 sizes \(rows columns\), got 3"):
        main(["synth", str(tmp_path), "--kind", "wsi", "--shape", "256", "256", "256"])
    with pytest.raises(SystemExit, match=r"monai-fast synth: size must be two sizes"):
        main(["synth", str(tmp_path), "--kind", "wsi", "--shape", "250", "256"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"workers": -1}, "workers must be >= 0"),
        ({"backend": "pillow"}, r"backend must be one of .*got 'pillow'"),
        ({"precision": "fp8"}, "fp8"),
    ],
)
def test_a_bad_pipeline_option_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PathologyConfig(**kwargs)


def test_an_unknown_variant_or_an_absent_backend_is_named_before_any_reading(small_set):
    train, val = load_wsi_datalist(small_set)
    with pytest.raises(ValueError, match=r"variant must be one of \('plain', 'fast'\), got 'quick'"):
        build_pathology("quick", train, val)
    with pytest.raises(RuntimeError, match=r"WSI backend 'cucim' cannot run here"):
        build_pathology("fast", train, val, PathologyConfig(backend="cucim"))
