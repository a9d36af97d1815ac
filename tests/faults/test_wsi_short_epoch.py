"""Whole-slide training never ends an epoch short and never reports an AUC from one.

Real tiled TIFF slides written with tifffile (a truncated one, one smaller than the patch), patch
lists with locations outside their slide, real MONAI engines and the pathology recipe at tiny size,
and the tutorial script run as a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from ignite.engine import Engine, Events
from monai.data import Dataset, PatchWSIDataset, ThreadDataLoader
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import ValidationHandler

from monai_fast.apps.recipes.pathology import SIZES, build_pathology, run_pathology
from monai_fast.apps.sources.wsi import generate_wsi, load_wsi_datalist
from monai_fast.apps.sources.wsi_reader import TiledTiffWSIReader
from monai_fast.data.items import DataItemError
from monai_fast.data.preflight import PreflightError, preflight_wsi, scan_slide
from monai_fast.handlers.guards import EpochLengthGuard, ShortEpochError

ROOT = Path(__file__).resolve().parents[2]
PATCH = 32


@pytest.fixture(scope="module")
def good_set(tmp_path_factory):
    s = SIZES["tiny"]
    root = tmp_path_factory.mktemp("wsi") / "good"
    return generate_wsi(root, s.slides, s.shape, s.tile, s.levels, PATCH, progress=False)


def _copy(good_set: Path, dest: Path, change=None) -> Path:
    """A copy of the good set, with ``change(meta)`` applied to its ``dataset.json``."""
    shutil.copytree(good_set, dest)
    if change is not None:
        meta = json.loads((dest / "dataset.json").read_text())
        change(meta)
        (dest / "dataset.json").write_text(json.dumps(meta))
    return dest


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _out_of_bounds(meta: dict) -> None:
    meta["training"][3]["location"] = [5000, 5000]  # far outside a 384 x 384 slide
    meta["validation"][1]["location"] = [2, 2]  # a centre this close to the corner: the patch starts at -14


def _config(**kw):
    return SIZES["tiny"].config(max_epochs=1, precision="fp32", **kw)


# --- preflight: named before training ------------------------------------------------------------------------------


def test_a_truncated_slide_is_named_by_the_preflight_before_any_training(good_set, tmp_path):
    root = _copy(good_set, tmp_path / "set")
    _truncate(root / "slides" / "slide_001.tif")
    train, val = load_wsi_datalist(root)
    with pytest.raises(PreflightError, match=r"slide_001.tif: cannot read the slide: level 0 is cut short") as e:
        build_pathology("fast", train, val, _config(), "cpu", run_dir=tmp_path / "run")
    assert len(e.value.problems) == 1  # one line for the slide, not one per patch on it
    assert not (tmp_path / "run").exists()  # nothing was built or written


def test_patch_locations_outside_their_slide_are_named_with_list_index_and_location(good_set, tmp_path):
    train, val = load_wsi_datalist(_copy(good_set, tmp_path / "set", _out_of_bounds))
    with pytest.raises(PreflightError) as e:
        run_pathology("plain", train, val, _config(), "cpu", run_dir=tmp_path / "run")
    text = str(e.value)
    assert "training[3]: the 32 x 32 patch at location (5000, 5000)" in text and "outside the slide's 384 x 384" in text
    assert "validation[1]: the 32 x 32 patch at location (2, 2) (rows -14..18, columns -14..18 at level 0)" in text
    assert len(e.value.problems) == 2 and not (tmp_path / "run").exists()


def test_many_bad_locations_on_one_slide_are_counted_not_all_listed(good_set, tmp_path):
    def far(meta):
        for item in meta["training"]:
            item["location"] = [9000, 9000]

    train, _ = load_wsi_datalist(_copy(good_set, tmp_path / "set", far))
    report = preflight_wsi({"training": train}, PATCH, cache=False, raise_error=False)
    per_slide = {}
    for path, reason in report.problems:
        per_slide.setdefault(path, []).append(reason)
    assert all(len(r) == 6 and r[-1].startswith("... and ") for r in per_slide.values())


def test_a_slide_smaller_than_the_patch_is_refused_not_zero_padded(tmp_path):
    slide = tmp_path / "small.tif"
    tifffile.imwrite(slide, np.full((16, 16, 3), 200, np.uint8), photometric="rgb", tile=(16, 16))
    items = [{"image": str(slide), "location": [8, 8], "label": [0]}]
    report = preflight_wsi(items, PATCH, cache=False, raise_error=False)
    assert report.problems == [
        (
            str(slide),
            "items[0]: the slide is 16 x 16 pixels at level 0, smaller than the 32 x 32 patch (it would be padded)",
        )
    ]
    reader = TiledTiffWSIReader(level=0)
    with pytest.raises(
        ValueError,
        match=r"small.tif: the 32 x 32 patch at row -8, column -8 of level 0 reaches "
        r"outside the level's 16 x 16 pixels",
    ):
        reader.get_data(reader.read(str(slide)), location=(-8, -8), size=(PATCH, PATCH))


def test_the_tile_aware_reader_names_a_truncated_tile(good_set, tmp_path):
    slide = tmp_path / "cut.tif"
    shutil.copy(good_set / "slides" / "slide_002.tif", slide)
    _truncate(slide)
    assert "cut short" in scan_slide(slide)["error"]
    reader = TiledTiffWSIReader(level=0)
    with pytest.raises(ValueError, match=r"cut.tif: tile \d+ of level 0 has \d+ of its \d+ bytes: the file is trunc"):
        reader.get_data(reader.read(str(slide)), location=(352, 352), size=(PATCH, PATCH))


def test_good_slides_pass_and_their_scans_are_cached(good_set, tmp_path):
    train, val = load_wsi_datalist(good_set)
    store = tmp_path / "preflight.json"
    first = preflight_wsi({"training": train, "validation": val}, PATCH, cache_path=store)
    again = preflight_wsi({"training": train, "validation": val}, PATCH, cache_path=store)
    assert first.ok and first.read == 3 and again.read == 0 and again.from_cache == 3


# --- during training: a failing patch is raised, an epoch never ends short -----------------------------------------


def test_without_the_preflight_the_fast_pipeline_raises_the_failing_patch_not_an_early_end(good_set, tmp_path):
    train, val = load_wsi_datalist(_copy(good_set, tmp_path / "set", _out_of_bounds))
    with pytest.raises(DataItemError, match=r"slide_00\d.tif.*(Location is outside of the image|reaches outside)"):
        run_pathology("fast", train, val, _config(preflight=False), "cpu", target=1.01)


def _monai_engines(train: list[dict], val: list[dict]) -> tuple[SupervisedTrainer, SupervisedEvaluator]:
    """A trainer and evaluator as a user builds them, on MONAI's ThreadDataLoader (a dying thread ends its pass)."""
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(1))

    def prepare(batch, device=None, non_blocking=False, **kw):
        label = torch.as_tensor(batch["label"]).float().reshape(-1, 1)
        return batch["image"].float().to(device) / 255.0, label.to(device)

    def loader(items, shuffle):
        dataset = PatchWSIDataset(items, patch_size=PATCH, reader=TiledTiffWSIReader(level=0))
        return ThreadDataLoader(dataset, batch_size=4, shuffle=shuffle)

    evaluator = SupervisedEvaluator(
        device="cpu", val_data_loader=loader(val, False), network=net, prepare_batch=prepare
    )
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=loader(train, True),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        loss_function=torch.nn.BCEWithLogitsLoss(),
        prepare_batch=prepare,
        train_handlers=[ValidationHandler(validator=evaluator, interval=1)],
    )
    return trainer, evaluator


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # MONAI's loader threads die
def test_a_loader_thread_that_dies_ends_monais_epoch_early_and_the_guard_raises_before_validation(good_set, tmp_path):
    train, val = load_wsi_datalist(_copy(good_set, tmp_path / "set", _out_of_bounds))
    train, val = train[:24], val[:12]  # 6 and 3 batches: seconds
    trainer, evaluator = _monai_engines(train, val)
    trainer.run()  # the defect guarded against: MONAI's loader threads die on the bad patches, yet the run "succeeds"
    assert trainer.state.epoch == 1 and evaluator.state.epoch == 1 and evaluator.state.iteration < 3

    trainer, evaluator = _monai_engines(train, val)
    EpochLengthGuard("training").attach(trainer)
    EpochLengthGuard("validation").attach(evaluator)
    with pytest.raises(ShortEpochError, match=r"the training data loader ended a pass after \d of its 6 batches"):
        trainer.run()
    assert evaluator.state.iteration == 0  # validation never ran on the short epoch


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_guard_stops_a_validation_whose_loader_ends_short(good_set, tmp_path):
    _, val = load_wsi_datalist(_copy(good_set, tmp_path / "set", _out_of_bounds))
    _, evaluator = _monai_engines(val[:12], val[:12])
    guard = EpochLengthGuard("validation")
    guard.attach(evaluator)
    scored = []
    evaluator.add_event_handler(Events.EPOCH_COMPLETED, lambda e: scored.append(e.state.iteration))
    with pytest.raises(ShortEpochError, match=r"the validation data loader ended a pass after 0 of its 3 batches"):
        evaluator.run()
    assert scored == []  # no metric of the short validation


@pytest.mark.parametrize(
    "how", ["normal", "terminate", "terminate_epoch", "epoch_length", "max_iters", "resume", "repeats"]
)
def test_the_guard_lets_complete_and_deliberately_ended_epochs_pass(how):
    data = ThreadDataLoader(Dataset(list(range(8))), batch_size=1, repeats=2) if how == "repeats" else list(range(8))

    def step(engine, batch):
        if how == "terminate" and engine.state.iteration == 3:
            engine.terminate()
        if how == "terminate_epoch" and engine.state.iteration == 3:
            engine.terminate_epoch()

    engine = Engine(step)
    guard = EpochLengthGuard()
    guard.attach(engine)
    kw = {"max_epochs": 3}
    if how == "epoch_length":
        kw["epoch_length"] = 3
    if how == "max_iters":
        kw = {"max_iters": 13}
    if how == "resume":
        engine.load_state_dict({"iteration": 5, "epoch_length": 8, "max_epochs": 3})
        kw = {}
    engine.run(data, **kw)
    expected = {
        "normal": 24,
        "terminate": 3,
        "terminate_epoch": 19,
        "epoch_length": 9,
        "max_iters": 13,
        "resume": 24,
        "repeats": 24,
    }[how]
    assert engine.state.iteration == expected


# --- the whole run, as a user starts it ----------------------------------------------------------------------------


def test_the_tutorial_on_a_truncated_slide_fails_naming_it_and_writes_no_results(good_set, tmp_path):
    root = _copy(good_set, tmp_path / "set")
    _truncate(root / "slides" / "slide_002.tif")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MONAI_FAST_CACHE": str(tmp_path / "cache")}
    cmd = [
        sys.executable,
        str(ROOT / "tutorials" / "pathology_tumor_detection.py"),
        "--tiny",
        "--device",
        "cpu",
        "--max-epochs",
        "1",
        "--precision",
        "fp32",
        "--data-dir",
        str(root),
        "--run-dir",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout
    assert "slide_002.tif: cannot read the slide: level 0 is cut short" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr  # one message, not a traceback
    assert not (tmp_path / "run" / "results.json").exists()
