"""Inference: a checkpoint's sliding-window predictions written as NIfTI on the input's grid, backends that agree
with eager fp32, clear errors for a missing backend or a bad checkpoint, the benchmark, the doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from inference_parts import CONFIG, images, write_model
from test_wall_clock import _engines

from monai_fast.apps.cli import main
from monai_fast.apps.inference import (
    BACKENDS,
    agreement,
    infer,
    load_checkpoint,
    missing,
)
from monai_fast.apps.inference.backends import precision_of
from monai_fast.apps.recipes.parts import build_network
from monai_fast.apps.sources.msd import load_msd_datalist
from monai_fast.handlers import RecordHandler
from monai_fast.report.doctor import doctor

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, tiny_spleen) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "model.pt", balance_on=images(tiny_spleen)[0])


def test_predictions_are_nifti_label_maps_with_the_inputs_affine_and_shape(model_file, tiny_spleen, tmp_path):
    two_images = images(tiny_spleen)
    result = infer(model_file, two_images, tmp_path / "out", progress=False)
    assert [p.name for p in result.outputs] == [Path(p).name.replace(".nii.gz", "_seg.nii.gz") for p in two_images]
    for image, pred in zip(two_images, result.outputs):
        src, out = nib.load(image), nib.load(pred)
        assert out.shape == src.shape[:3]
        np.testing.assert_allclose(out.affine, src.affine, atol=1e-4)  # LPS input: resampled to RAS and back
        values = np.unique(np.asarray(out.dataobj))
        assert set(values.tolist()) == {0, 1} and out.get_data_dtype() == np.uint8
    assert len(result.seconds) == 2 and result.volumes_per_s > 0


def test_an_msd_folder_infers_the_validation_split_of_training(model_file, tiny_spleen, tmp_path):
    result = infer(model_file, tiny_spleen, tmp_path / "out", progress=False)
    _, val = load_msd_datalist(tiny_spleen, val_fraction=0.25, seed=CONFIG.seed)
    assert result.inputs == [d["image"] for d in val]
    assert all(p.is_file() for p in result.outputs)


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(b, marks=[pytest.mark.slow] if b == "compile" else [])  # compiles
        for b in BACKENDS
        if b not in ("eager", "tensorrt")
    ],
)
def test_each_available_backend_agrees_with_eager_fp32(backend, model_file, tiny_spleen, tmp_path):
    two_images = images(tiny_spleen)
    lacking = missing(backend, "cpu")
    if lacking is not None:
        pytest.skip(f"backend {backend} not available here: needs {lacking}")
    eager = infer(model_file, two_images, tmp_path / "eager", progress=False)
    other = infer(model_file, two_images, tmp_path / backend, backend=backend, progress=False)
    for a, b in zip(eager.outputs, other.outputs):
        reference = np.asarray(nib.load(a).dataobj)
        assert 0.2 < reference.mean() < 0.8  # many voxels near a tie: agreement is not trivial
        agree = agreement(reference, np.asarray(nib.load(b).dataobj))
        assert agree["voxels"] >= 0.99 and agree["dice"] >= 0.99, (backend, agree)


def test_auto_sliding_window_is_measured_once_then_read_from_the_store_and_agrees(
    model_file, tiny_spleen, tmp_path, caplog
):
    two_images = images(tiny_spleen)
    store = tmp_path / "tuning.json"
    eager = infer(model_file, two_images, tmp_path / "fixed", progress=False)
    with caplog.at_level("INFO", logger="monai_fast"):
        auto = infer(
            model_file,
            two_images,
            tmp_path / "auto",
            sw_batch_size="auto",
            tune_store=store,
            sw_batch_range=(1, 2),
            progress=False,
        )
        infer(
            model_file,
            two_images,
            tmp_path / "again",
            sw_batch_size="auto",
            tune_store=store,
            sw_batch_range=(1, 2),
            progress=False,
        )
    entries = json.loads(store.read_text())
    assert len(entries["results"] if "results" in entries else entries) == 1
    measured = [r.getMessage() for r in caplog.records if r.getMessage().startswith("infer: sw_batch_size")]
    assert len(measured) == 2 and sum("using the cached result" in r.getMessage() for r in caplog.records) == 1
    for a, b in zip(eager.outputs, auto.outputs):
        agree = agreement(np.asarray(nib.load(a).dataobj), np.asarray(nib.load(b).dataobj))
        assert agree["voxels"] >= 0.99, agree


def test_the_cli_names_a_bad_sw_batch_size(model_file, tiny_spleen, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["infer", str(model_file), *images(tiny_spleen), "--out", str(tmp_path / "out"), "--sw-batch-size", "0"])
    assert "--sw-batch-size" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_training_checkpoint_loads_with_the_config_passed(tmp_path):
    net = build_network(CONFIG, torch.device("cpu"))
    # a CheckpointFolder's file
    torch.save({"trainer": {"epoch": 3}, "model": net.state_dict()}, tmp_path / "ckpt-000000003.pt")
    loaded, config = load_checkpoint(tmp_path / "ckpt-000000003.pt", config=CONFIG)
    assert config == CONFIG and not loaded.training
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), net.state_dict().values()))


def test_the_cli_writes_predictions_and_prints_one_line(model_file, tiny_spleen, tmp_path, capsys):
    two_images = images(tiny_spleen)
    assert main(["infer", str(model_file), *two_images, "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        Path(p).name.replace(".nii.gz", "_seg.nii.gz") for p in two_images
    )
    assert capsys.readouterr().out.startswith(f"wrote 2 predictions to {tmp_path / 'out'} (backend eager: fp32 on cpu")


def test_the_benchmark_runs_at_tiny_size_and_reports_each_backend(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "benchmarks/inference.py",
        "--tiny",
        "--backends",
        "eager",
        "autocast",
        "onnx",
        "tensorrt",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["backend"]: r for r in json.loads(next(tmp_path.glob("inference_*.json")).read_text())["rows"]}
    assert rows["eager"]["available"] and rows["eager"]["dice_vs_eager"] == 1.0 and rows["eager"]["latency_s"] > 0
    assert not rows["tensorrt"]["available"] and "CUDA GPU" in rows["tensorrt"]["missing"]
    if missing("onnx") is None:
        assert rows["onnx"]["agrees"] and rows["onnx"]["volumes_per_s"] > 0 and rows["onnx"]["peak_mib"] > 0
    if precision_of("autocast", "cpu") == "fp32":  # no bf16 hardware: autocast is fp32, judged like the others
        assert rows["autocast"]["agrees"] is True
    else:  # bf16 on random weights: near-tied logits; Dice shown, not judged
        assert rows["autocast"]["agrees"] is None and 0 <= rows["autocast"]["dice_vs_eager"] <= 1
        assert "| n/a (random weights) |" in done.stdout
    assert "| backend | runs as |" in done.stdout


def test_the_doctor_adds_an_inference_section_only_to_a_run_that_validated(tmp_path):
    for name, validated in (("with", True), ("without", False)):
        record = RecordHandler(tmp_path / name)
        trainer, _ = _engines(record, val_in_thread=not validated)  # in a thread: the evaluator is never run
        trainer.run()
    d = doctor(tmp_path / "with")
    share = d.numbers["wall_clock"]["shares"]["validation"]
    assert share > 0 and d.numbers["inference"]["share"] == pytest.approx(share)
    assert f"{100 * share:.1f}% of the wall clock" in d.text() and "benchmarks/inference.py" in d.text()
    assert "## Inference" in (tmp_path / "with" / "report.md").read_text()
    d = doctor(tmp_path / "without")
    assert "inference" not in d.numbers and "## Inference" not in (tmp_path / "without" / "report.md").read_text()
