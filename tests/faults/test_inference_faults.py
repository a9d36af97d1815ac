"""Inference faults: a backend this machine cannot run, a bad checkpoint and bad images each end in one error
that names them, before any volume is read or any prediction written."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from inference_parts import CONFIG, images, write_model  # noqa: E402

from monai_fast.cli import main  # noqa: E402
from monai_fast.data.preflight import PreflightError  # noqa: E402
from monai_fast.inference import BackendUnavailable, CheckpointError, infer  # noqa: E402
from monai_fast.recipes import RecipeConfig  # noqa: E402
from monai_fast.recipes.common import build_network  # noqa: E402


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
    with pytest.raises(BackendUnavailable, match=r"backend 'onnx' .* needs the Python package\(s\) [a-z, ]*onnxruntime"
                                                 r"[a-z, ]* \(pip install 'monai-fast\[infer\]'\)"):
        infer(model_file, [str(tmp_path / "never-read.nii.gz")], tmp_path / "out", backend="onnx")


def test_the_cli_says_a_missing_backend_in_one_line(model_file, tiny_spleen, tmp_path):
    two_images = images(tiny_spleen)
    with pytest.raises(SystemExit) as e:
        main(["infer", str(model_file), two_images[0], "--out", str(tmp_path / "out"), "--backend", "tensorrt",
              "--device", "cpu", "--no-progress"])
    text = str(e.value.code)
    assert text.startswith("monai-fast infer: backend 'tensorrt' is not available here") and "\n" not in text


def _other_network(path: Path) -> Path:
    write_model(path, RecipeConfig(**{**CONFIG.to_dict(), "channels": (2, 4, 8)}))
    data = torch.load(path, weights_only=True)
    data["config"] = CONFIG.to_dict()  # weights of one network, the config of another
    torch.save(data, path)
    return path


BAD_CHECKPOINTS = {
    "missing": (lambda p: p, "no such file"),
    "garbage": (lambda p: (p.write_bytes(b"not a checkpoint" * 10), p)[1], "cannot be read as a torch.save file: not a zip"),
    "whole model": (lambda p: (torch.save(build_network(CONFIG, torch.device("cpu")), p), p)[1],
                    "holds pickled Python objects.*save_checkpoint"),
    "no config": (lambda p: (torch.save({"model": build_network(CONFIG, torch.device("cpu")).state_dict()}, p), p)[1],
                  "no 'config' to rebuild the network from .*--recipe-config FILE"),
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
        infer(model_file, [two_images[1], str(broken), str(tmp_path / "absent.nii.gz")], tmp_path / "out", progress=False)
    assert [p for p, _ in e.value.problems] == [str(broken), str(tmp_path / "absent.nii.gz")]
    assert not (tmp_path / "out").exists()


