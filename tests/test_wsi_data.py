"""Synthetic whole-slide images (``monai-fast synth --kind wsi``) and the WSI readers that read them."""

from __future__ import annotations

import csv
import json
import logging

import numpy as np
import pytest
import tifffile
from monai.data import PatchWSIDataset
from monai.data.wsi_reader import WSIReader

from monai_fast.apps.cli import main
from monai_fast.apps.sources.wsi import MASK_DOWNSAMPLE, generate_wsi, load_wsi_datalist
from monai_fast.apps.sources.wsi_reader import TiledTiffWSIReader, WSIBackendError, choose_wsi_backend

SIZE, PATCH = (512, 384), 32


@pytest.fixture(scope="module")
def wsi_root(tmp_path_factory):
    return generate_wsi(
        tmp_path_factory.mktemp("wsi") / "set",
        num_slides=3,
        size=SIZE,
        tile=128,
        levels=3,
        patch_size=PATCH,
        progress=False,
    )


def test_slides_are_tiled_pyramids_that_monais_tifffile_reader_reads_level_by_level(wsi_root):
    with tifffile.TiffFile(wsi_root / "slides" / "slide_001.tif") as tif:
        assert [p.shape for p in tif.pages] == [(512, 384, 3), (256, 192, 3), (128, 96, 3)]
        assert all(p.is_tiled and (p.tilelength, p.tilewidth) == (128, 128) for p in tif.pages[:2])
        assert [p.subfiletype for p in tif.pages] == [0, 1, 1]  # reduced-resolution pages, as Camelyon's
    reader = WSIReader(backend="tifffile")
    wsi = reader.read(str(wsi_root / "slides" / "slide_001.tif"))
    assert reader.get_level_count(wsi) == 3 and reader.get_downsample_ratio(wsi, 2) == 4.0
    patch, _ = reader.get_data(wsi, location=(0, 0), size=(128, 96), level=2)
    assert patch.shape == (3, 128, 96) and patch.dtype == np.uint8


def test_patch_lists_agree_with_the_csv_and_labels_follow_the_tumour_mask(wsi_root):
    train, val = load_wsi_datalist(wsi_root)
    assert {p["image"].rsplit("/", 1)[-1] for p in val} == {
        "slide_003.tif"
    }  # the last quarter (at least one) validates
    assert {p["image"].rsplit("/", 1)[-1] for p in train} == {"slide_001.tif", "slide_002.tif"}
    with open(wsi_root / "patches.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(train) + len(val)
    assert {(r["image"], int(r["y"]), int(r["x"]), int(r["label"])) for r in rows} == {
        (p["image"].rsplit("/", 1)[-1][:-4], *p["location"], p["label"][0]) for p in train + val
    }
    labels = {0: 0, 1: 0}
    for p in train + val:
        name = p["image"].rsplit("/", 1)[-1][:-4]
        tumour = tifffile.imread(wsi_root / "masks" / f"{name}_tumor.tif") > 0
        r, c = (v // MASK_DOWNSAMPLE for v in p["location"])
        labels[p["label"][0]] += 1
        window = tumour[max(0, r - 1) : r + 1, max(0, c - 1) : c + 1]  # the patch's centre, on the mask grid
        assert window.any() if p["label"][0] else not window.all(), p
    assert labels[0] > 0 and labels[1] > 0


def test_tumour_patches_look_different_from_normal_ones(wsi_root):
    train, _ = load_wsi_datalist(wsi_root)
    ds = PatchWSIDataset(train, patch_size=PATCH, patch_level=0, reader="tifffile")
    means = {0: [], 1: []}
    for i in range(len(ds)):
        means[int(ds[i]["label"][0])].append(float(ds[i]["image"].float().mean()))
    assert np.mean(means[1]) < np.mean(means[0]) - 5  # crowded, darker nuclei


def test_the_same_seed_writes_the_same_slide(tmp_path):
    a, b = (
        generate_wsi(
            tmp_path / n, num_slides=2, size=(256, 256), tile=128, levels=2, patch_size=32, seed=5, progress=False
        )
        for n in ("a", "b")
    )
    c = generate_wsi(
        tmp_path / "c", num_slides=2, size=(256, 256), tile=128, levels=2, patch_size=32, seed=6, progress=False
    )
    read = lambda root: tifffile.imread(root / "slides" / "slide_002.tif")  # noqa: E731
    assert np.array_equal(read(a), read(b)) and not np.array_equal(read(a), read(c))


def test_tiled_reader_returns_monais_patch_at_every_level_and_never_decodes_a_whole_level(wsi_root, monkeypatch):
    path = str(wsi_root / "slides" / "slide_002.tif")
    monai_reader, tiled = WSIReader(backend="tifffile"), TiledTiffWSIReader()
    expected_wsi, wsi = monai_reader.read(path), tiled.read(path)
    monkeypatch.setattr(type(wsi), "asarray", lambda *a, **k: pytest.fail("the tiled reader decoded a whole level"))
    rng = np.random.default_rng(0)
    for level in (0, 1):
        for _ in range(20):
            size = tuple(int(v) for v in rng.integers(1, 100, size=2))
            loc = tuple(
                int(v) for v in rng.integers(0, [SIZE[i] - size[i] * 2**level + 1 for i in (0, 1)])
            )  # inside the slide
            got, _ = tiled.get_data(wsi, location=loc, size=size, level=level)
            monkeypatch.undo()
            want, _ = monai_reader.get_data(expected_wsi, location=loc, size=size, level=level)
            monkeypatch.setattr(
                type(wsi), "asarray", lambda *a, **k: pytest.fail("the tiled reader decoded a whole level")
            )
            assert np.array_equal(got, want), (level, loc, size)


def test_auto_backend_on_a_cpu_is_never_cucim_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="monai_fast.apps.sources.wsi_reader"):
        backend = choose_wsi_backend("auto", "cpu")
    assert backend.name in ("openslide", "tifffile")
    assert "not cucim:" in backend.why and "WSI backend:" in caplog.text
    reader = backend.make(level=0)
    assert reader.backend == backend.name


def test_asking_for_cucim_where_it_cannot_run_names_what_is_missing():
    with pytest.raises(
        WSIBackendError, match=r"WSI backend 'cucim' cannot run here: (cucim not installed|cuCIM needs a CUDA GPU)"
    ):
        choose_wsi_backend("cucim", "cpu")
    with pytest.raises(ValueError, match=r"WSI backend must be one of .*got 'pillow'"):
        choose_wsi_backend("pillow")


def test_synth_command_writes_a_wsi_set(tmp_path, capsys):
    assert (
        main(
            [
                "synth",
                str(tmp_path / "w"),
                "--kind",
                "wsi",
                "--cases",
                "2",
                "--shape",
                "256",
                "256",
                "--tile",
                "128",
                "--levels",
                "2",
                "--patch",
                "32",
                "--no-progress",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(
        f"wrote 2 wsi slides (pyramidal TIFF, masks, patches.csv, dataset.json) to {tmp_path / 'w'}"
    )
    meta = json.loads((tmp_path / "w" / "dataset.json").read_text())
    assert meta["monai_fast"]["size"] == [256, 256] and len(meta["slides"]) == 2


def test_the_slide_scan_gives_every_level_and_opens_other_formats_only_with_a_reader(wsi_root, tmp_path):
    from monai_fast.data.preflight import scan_slide

    assert scan_slide(wsi_root / "slides" / "slide_001.tif") == {"levels": [[512, 384], [256, 192], [128, 96]]}
    other = tmp_path / "slide.svs-like"
    other.write_bytes(b"\x89PNG not a tiff")
    assert scan_slide(other) == {"error": "not a TIFF file, and no WSI reader was given to open it"}
    assert scan_slide(other, reader=WSIReader(backend="tifffile"))["error"].startswith("TiffFileError")


def test_the_tiled_reader_refuses_a_patch_that_reaches_past_the_edge(wsi_root):
    reader = TiledTiffWSIReader()
    wsi = reader.read(str(wsi_root / "slides" / "slide_001.tif"))
    patch, _ = reader.get_data(wsi, location=(SIZE[0] - PATCH, SIZE[1] - PATCH), size=(PATCH, PATCH))  # the last corner
    assert patch.shape == (3, PATCH, PATCH)
    with pytest.raises(
        ValueError,
        match=r"slide_001.tif: the 32 x 32 patch at row 481, column 352 of level 0 reaches "
        r"outside the level's 512 x 384 pixels",
    ):
        reader.get_data(wsi, location=(SIZE[0] - PATCH + 1, SIZE[1] - PATCH), size=(PATCH, PATCH))
    with pytest.raises(
        ValueError,
        match=r"the 32 x 150 patch at row 64, column 48 of level 1 reaches outside the "
        r"level's 256 x 192 pixels",
    ):
        reader.get_data(wsi, location=(128, 96), size=(PATCH, 150), level=1)
