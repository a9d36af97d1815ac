"""Bundles of other kinds than 3-D segmentation, run with and without FastTraining.

Real parts: two bundles in the Model Zoo's layout written for these tests, parsed by MONAI's own
``ConfigWorkflow`` through :func:`~monai_fast.bundle.run_bundle`, on data written to disk here:

* ``tests/bundles/cls2d``: 2-D classification of RGB PNG files (a JSON datalist read with MONAI's
  ``load_decathlon_datalist``, ``LoadImaged``), DenseNet121 with ``spatial_dims=2``, cross-entropy,
  a ``SupervisedEvaluator`` with an accuracy key metric, ``CheckpointSaver`` and ``MetricsSaver``.
* ``tests/bundles/patho``: patch classification in the shape of the zoo's ``pathology_tumor_detection``:
  patches read by MONAI's ``PatchWSIDataset`` from pyramidal TIFF slides
  (:func:`~monai_fast.apps.sources.wsi.generate_wsi`, the lists from its ``dataset.json``), a 2-D ResNet-18,
  BCE with logits, Novograd, an evaluator with an accuracy key metric and ``CheckpointSaver``.

For each: both runs train and write the bundle's outputs, FastTraining's decisions fit a 2-D network
(no ``channels_last_3d``, no sliding-window tuning, precision decided) and the doctor's verdict
advises nothing 3-D or sliding-window.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bundle_parts import copy_bundle, small_cls2d, write_shapes

from monai_fast.apps.sources.wsi import generate_wsi
from monai_fast.bundle import run_bundle
from monai_fast.telemetry.record import load_record

#: what a verdict for a 2-D network without a sliding window must not advise
THREE_D = ("channels_last_3d", "sliding-window", "sliding window", "sw_batch_size", "SlidingWindowInferer")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_shapes(tmp_path_factory.mktemp("shapes"))


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    return generate_wsi(
        tmp_path_factory.mktemp("slides"),
        num_slides=2,
        size=(256, 256),
        tile=64,
        levels=2,
        patch_size=32,
        progress=False,
    )


def small_patho(data: Path) -> dict:
    """The same for the pathology bundle; the slides are read with monai-fast's tile-aware tifffile reader
    (the zoo's bundle names cuCIM, a GPU package)."""
    return {
        "dataset_dir": str(data),
        "num_epochs": 1,
        "patch_size": [32, 32],
        "device": "$torch.device('cpu')",
        "wsi_reader": {"_target_": "monai_fast.apps.sources.wsi_reader.TiledTiffWSIReader", "level": 0},
        "network_def#widen_factor": 0.125,
        "train#dataloader#batch_size": 16,
        "train#dataloader#num_workers": 0,
        "validate#dataloader#batch_size": 32,
        "validate#dataloader#num_workers": 0,
    }


def _check_2d_decisions(applied: dict) -> None:
    """FastTraining's decisions for a 2-D network validated without a sliding window."""
    assert applied["memory_format"]["setting"] == "contiguous" and not applied["memory_format"]["applied"]
    assert "channels_last_3d" not in json.dumps(applied), applied
    assert not applied["evaluator"]["applied"] and "nothing to tune" in applied["evaluator"]["reason"]
    assert "sliding-window settings" not in json.dumps(applied)  # no sliding-window advice for a SimpleInferer
    assert not applied["prediction_layout"]["applied"], applied["prediction_layout"]  # 2-D predictions: nothing to do
    assert applied["precision"]["setting"] in ("bf16", "fp32")  # decided: MONAI's amp=True does nothing on a CPU
    assert "amp=True" in applied["precision"]["reason"]


def _check_verdict(verdict: str | None) -> None:
    assert verdict and verdict.startswith("verdict:")
    advice = verdict.split("what to change:", 1)[1].split("where the wall clock went:", 1)[0]
    assert not [w for w in THREE_D if w in advice], advice


def _trained(run_dir: Path, epochs: int) -> None:
    rows, _ = load_record(run_dir)
    assert len([r for r in rows if r.get("kind") == "epoch" and r.get("engine") == "train"]) >= epochs, rows[-5:]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "as-published"])
def test_a_2d_classification_bundle(tmp_path, shapes, fast):
    bundle = copy_bundle("cls2d", tmp_path)
    result = run_bundle(bundle, overrides=small_cls2d(shapes), fast=fast, logging_file=False)
    assert result.run_dir.parent == bundle / "eval" / "monai_fast"
    assert result.run_dir.name.startswith("fast-" if fast else "published-")
    _trained(result.run_dir, epochs=2)
    assert (bundle / "models" / "model.pt").is_file()  # CheckpointSaver on the key metric
    assert "val_accuracy" in (bundle / "eval" / "metrics.csv").read_text()  # MetricsSaver
    assert any(p.name.startswith("events.out.tfevents") for p in (bundle / "eval").iterdir())
    assert 0.0 <= result.metrics["validate/val_accuracy"] <= 1.0 and "validate/best" in result.metrics
    assert "train/train_accuracy" in result.metrics
    if fast:
        _check_2d_decisions(result.applied)
        # a plain Dataset of PNG files: its deterministic transforms are cached (the bundle has no cache of its own)
        assert result.applied["data"]["applied"] and result.applied["data"]["setting"] == "ram", result.applied["data"]
    else:
        assert result.applied == {}
    _check_verdict(result.verdict)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "as-published"])
def test_a_pathology_patch_bundle(tmp_path, slides, fast):
    bundle = copy_bundle("patho", tmp_path)
    result = run_bundle(bundle, overrides=small_patho(slides), fast=fast, logging_file=False)
    assert result.run_dir.parent == bundle / "log" / "monai_fast"  # the zoo's pathology bundles write to log/
    _trained(result.run_dir, epochs=1)
    assert (bundle / "models" / "model.pt").is_file()
    assert any(p.name.startswith("events.out.tfevents") for p in (bundle / "log").iterdir())
    assert 0.0 <= result.metrics["validate/valid_acc"] <= 1.0 and "train/train_acc" in result.metrics
    if fast:
        _check_2d_decisions(result.applied)
        # PatchWSIDataset reads the patch in its own _transform: the data set is kept, and the reason says so
        for lever in ("data", "validation data"):
            assert not result.applied[lever]["applied"]
            assert "PatchWSIDataset has its own _transform" in result.applied[lever]["reason"]
    else:
        assert result.applied == {}
    _check_verdict(result.verdict)
