"""Inference faults: a backend this machine cannot run, a bad checkpoint and bad images each end in one error
that names them, before any volume is read or any prediction written."""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
from pathlib import Path

import nibabel as nib
import pytest
import torch
from inference_parts import CONFIG, images, write_model
from monai.data import DataLoader
from monai.losses import DiceLoss

from monai_fast.apps.cli import main
from monai_fast.apps.inference import BackendUnavailable, CheckpointError, infer
from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.recipes.parts import build_network
from monai_fast.data.preflight import PreflightError


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "model.pt")


def test_a_backend_without_its_hardware_is_one_error_naming_it_before_any_volume_is_read(model_file, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(BackendUnavailable, match=r"backend 'tensorrt' is not available here: it needs .*a CUDA GPU"):
        infer(model_file, [str(tmp_path / "never-read.nii.gz")], out, backend="tensorrt", device="cpu")
    assert not out.exists()


def test_a_backend_without_its_package_names_the_package_and_the_install(model_file, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # how Python blocks an import: as if not installed
    with pytest.raises(
        BackendUnavailable,
        match=r"backend 'onnx' .* needs the Python package\(s\) [a-z, ]*onnxruntime"
        r"[a-z, ]* \(pip install \"monai-fast\[onnx\]\"\)",
    ):
        infer(model_file, [str(tmp_path / "never-read.nii.gz")], tmp_path / "out", backend="onnx")


def test_the_cli_says_a_missing_backend_in_one_line(model_file, tiny_spleen, tmp_path):
    two_images = images(tiny_spleen)
    with pytest.raises(SystemExit) as e:
        main(
            [
                "infer",
                str(model_file),
                two_images[0],
                "--out",
                str(tmp_path / "out"),
                "--backend",
                "tensorrt",
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
    text = str(e.value.code)
    assert text.startswith("monai-fast infer: backend 'tensorrt' is not available here") and "\n" not in text


@pytest.mark.parametrize("data", [["s3://bucket/Task09"], ["a.nii.gz", "s3://bucket/Task09"]])
def test_the_cli_says_in_one_line_that_it_reads_no_url(model_file, tmp_path, data):
    with pytest.raises(SystemExit) as e:
        main(["infer", str(model_file), *data, "--out", str(tmp_path / "out"), "--no-progress"])
    text = str(e.value.code)
    assert (
        text == "monai-fast infer: s3://bucket/Task09: infer reads local files; copy the images to this machine first"
    )


def _other_network(path: Path) -> Path:
    write_model(path, RecipeConfig(**{**CONFIG.to_dict(), "channels": (2, 4, 8)}))
    data = torch.load(path, weights_only=True)
    data["config"] = CONFIG.to_dict()  # weights of one network, the config of another
    torch.save(data, path)
    return path


BAD_CHECKPOINTS = {
    "missing": (lambda p: p, "no such file"),
    "garbage": (
        lambda p: (p.write_bytes(b"not a checkpoint" * 10), p)[1],
        "cannot be read as a torch.save file: not a zip",
    ),
    "whole model": (
        lambda p: (torch.save(build_network(CONFIG, torch.device("cpu")), p), p)[1],
        "holds pickled Python objects.*save_checkpoint",
    ),
    "no config": (
        lambda p: (torch.save({"model": build_network(CONFIG, torch.device("cpu")).state_dict()}, p), p)[1],
        "no 'config' to rebuild the network from .*--recipe-config FILE",
    ),
    "wrong weights": (_other_network, "weights do not fit the UNet its config describes"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_a_bad_checkpoint_is_named_in_one_error_before_any_volume_is_read(case, tmp_path):
    make, reason = BAD_CHECKPOINTS[case]
    path = make(tmp_path / "model.pt")
    # the only image does not exist: reading any volume (or checking it) would raise something else
    with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(path))}.*{reason}") as e:
        infer(path, [str(tmp_path / "never-read.nii.gz")], tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_bad_images_are_listed_in_one_error_before_any_inference(model_file, tiny_spleen, tmp_path):
    two_images = images(tiny_spleen)
    broken = tmp_path / "broken.nii.gz"
    broken.write_bytes(Path(two_images[0]).read_bytes()[:200])
    with pytest.raises(PreflightError) as e:
        infer(
            model_file, [two_images[1], str(broken), str(tmp_path / "absent.nii.gz")], tmp_path / "out", progress=False
        )
    assert [p for p, _ in e.value.problems] == [str(broken), str(tmp_path / "absent.nii.gz")]
    assert not (tmp_path / "out").exists()


def _cli_error(argv: list[str]) -> str:
    """The one line ``monai-fast infer`` ends with (its exit message)."""
    with pytest.raises(SystemExit) as e:
        main(["infer", *argv, "--device", "cpu", "--no-progress"])
    text = str(e.value.code)
    assert text.startswith("monai-fast infer: ") and "\n" not in text
    return text


def test_a_prediction_that_would_replace_an_input_is_refused_before_any_work(model_file, tiny_spleen, tmp_path):
    """``infer a.nii.gz a_seg.nii.gz --out <their folder>``: a's prediction is a_seg.nii.gz, the second input."""
    folder = tmp_path / "cases"
    folder.mkdir()
    a, a_seg = folder / "a.nii.gz", folder / "a_seg.nii.gz"
    a.write_bytes(Path(images(tiny_spleen)[0]).read_bytes())
    a_seg.write_bytes(Path(images(tiny_spleen)[1]).read_bytes())
    before = {p: p.read_bytes() for p in (a, a_seg)}
    for extra in ([], ["--overwrite"]):  # never, whatever --overwrite says
        text = _cli_error([str(model_file), str(a), str(a_seg), "--out", str(folder), *extra])
        assert f"would be written to {a_seg}, which is the input image {a_seg}" in text
    assert {p: p.read_bytes() for p in (a, a_seg)} == before and sorted(folder.iterdir()) == [a, a_seg]


def test_an_output_folder_that_is_the_inputs_by_another_path_is_refused(model_file, tiny_spleen, tmp_path):
    folder = tmp_path / "cases"
    folder.mkdir()
    (folder / "b.nii.gz").write_bytes(Path(images(tiny_spleen)[0]).read_bytes())
    (folder / "b_seg.nii.gz").symlink_to(folder / "b.nii.gz")  # the prediction's name, a link to the input
    text = _cli_error([str(model_file), str(folder / "b.nii.gz"), "--out", str(folder), "--overwrite"])
    assert "which is the input image" in text


def test_existing_predictions_are_kept_unless_overwrite_is_given(model_file, tiny_spleen, tmp_path):
    image = images(tiny_spleen)[0]
    out = tmp_path / "out"
    out.mkdir()
    old = out / Path(image).name.replace(".nii.gz", "_seg.nii.gz")
    old.write_bytes(b"an earlier prediction")
    text = _cli_error([str(model_file), image, "--out", str(out)])
    assert f"1 prediction file(s) exist already: {old}; pass --overwrite" in text
    assert old.read_bytes() == b"an earlier prediction"
    assert (
        main(["infer", str(model_file), image, "--out", str(out), "--overwrite", "--device", "cpu", "--no-progress"])
        == 0
    )
    assert nib.load(old).shape == nib.load(image).shape


@pytest.fixture
def small_disk(tmpfs):
    """A real 2 MiB tmpfs with an empty ``out`` folder, filled to the last byte: no room for a prediction."""
    disk = tmpfs("size=2M", "disk")
    (disk / "out").mkdir()
    with open(disk / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    assert shutil.disk_usage(disk).free < 4096
    return disk


def test_a_full_output_disk_is_one_line_naming_the_prediction_and_nothing_is_half_written(
    model_file, tiny_spleen, small_disk
):
    image = images(tiny_spleen)[0]
    out = small_disk / "out"
    text = _cli_error([str(model_file), image, "--out", str(out)])
    target = out / Path(image).name.replace(".nii.gz", "_seg.nii.gz")
    assert re.fullmatch(
        rf"monai-fast infer: prediction {re.escape(str(target))}: no space left on the device; "
        r"needs [\d.]+ [KM]i?B, [\d.]+ [KM]i?B free .*",
        text,
    ), text
    assert list(out.iterdir()) == []  # no prediction under its name, no temporary file left behind


def _checkpoint_saver_file(folder: Path, single: bool) -> Path:
    """A MONAI ``CheckpointSaver`` file of a recipe UNet trained one epoch by a real ``SupervisedTrainer``."""
    from monai.engines import SupervisedTrainer
    from monai.handlers import CheckpointSaver

    net = build_network(CONFIG, torch.device("cpu"))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    data = [{"image": torch.rand(1, 16, 16, 16), "label": (torch.rand(1, 16, 16, 16) > 0.5).float()} for _ in range(2)]
    trainer = SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=1,
        train_data_loader=DataLoader(data, batch_size=1),
        network=net,
        optimizer=opt,
        loss_function=DiceLoss(to_onehot_y=True, softmax=True),
    )
    save = {"net": net} if single else {"net": net, "opt": opt}
    CheckpointSaver(str(folder), save, save_final=True, final_filename="final.pt").attach(trainer)
    trainer.run()
    return folder / "final.pt"


@pytest.mark.parametrize("single", [True, False], ids=["weights only", "net and optimizer"])
def test_a_monai_checkpoint_saver_file_says_what_to_pass_and_runs_with_recipe_config(single, tiny_spleen, tmp_path):
    from monai_fast.files import write_json

    saved = _checkpoint_saver_file(tmp_path / "ckpt", single)
    image = images(tiny_spleen)[0]
    text = _cli_error([str(saved), image, "--out", str(tmp_path / "out")])
    assert f"checkpoint {saved} holds network weights but no 'config'" in text and "--recipe-config FILE" in text
    assert not any((tmp_path / "out").iterdir())  # the command checked it can write there; nothing written
    recipe_json = write_json({"recipe": "baseline", "config": CONFIG.to_dict()}, tmp_path / "recipe.json")
    assert (
        main(
            [
                "infer",
                str(saved),
                image,
                "--out",
                str(tmp_path / "out"),
                "--recipe-config",
                str(recipe_json),
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    written = tmp_path / "out" / Path(image).name.replace(".nii.gz", "_seg.nii.gz")
    assert nib.load(written).shape == nib.load(image).shape


def test_a_bad_recipe_config_is_named(model_file, tiny_spleen, tmp_path):
    bad = tmp_path / "recipe.json"
    bad.write_text('{"channels": [4, 8, 16], "stride": [2, 2]}')
    text = _cli_error(
        [str(model_file), images(tiny_spleen)[0], "--out", str(tmp_path / "out"), "--recipe-config", str(bad)]
    )
    assert f"recipe config {bad}: unknown recipe option(s) ['stride']" in text
