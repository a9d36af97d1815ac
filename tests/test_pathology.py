"""The pathology pipelines (plain vs fast), the batch augmentation, the tutorial and the benchmark at tiny size."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from monai.data import ThreadDataLoader
from monai.data.wsi_reader import TiffFileWSIReader
from monai.optimizers import Novograd

from monai_fast.apps.recipes import pathology_augment
from monai_fast.apps.recipes.pathology import SIZES, build_pathology, run_pathology
from monai_fast.apps.recipes.pathology_augment import AugmentingPrepareBatch, TorchBatchAugment, batch_augment
from monai_fast.apps.sources.wsi import generate_wsi, load_wsi_datalist
from monai_fast.apps.sources.wsi_reader import TiledTiffWSIReader
from monai_fast.handlers import AMPToggle
from monai_fast.handlers.lifecycle import handlers_on

ROOT = Path(__file__).resolve().parents[1]
NO_JITTER = {"brightness": 0.0, "contrast": 0.0, "saturation": 0.0}


@pytest.fixture(scope="module")
def patches(tmp_path_factory):
    s = SIZES["tiny"]
    root = generate_wsi(
        tmp_path_factory.mktemp("wsi"), s.slides, s.shape, s.tile, s.levels, s.patch_size, progress=False
    )
    return load_wsi_datalist(root)


def _variants_of(x: torch.Tensor) -> list[torch.Tensor]:
    """The 8 flips / 90-degree turns of a CHW patch."""
    return [torch.rot90(f, k, dims=(-2, -1)) for f in (x, x.flip(-1)) for k in range(4)]


def test_torch_batch_augment_gives_float_in_minus_one_to_one_from_uint8():
    x = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    y = TorchBatchAugment(prob=0.5)(x)
    assert y.dtype == torch.float32 and y.shape == x.shape and y.min() >= -1.0 and y.max() <= 1.0
    identity = TorchBatchAugment(prob=0.0, jitter=NO_JITTER)(x)
    assert torch.allclose(identity, x.float() / 127.5 - 1.0, atol=1e-5)


def test_torch_batch_augment_draws_a_flip_and_a_turn_per_patch():
    torch.manual_seed(0)
    x = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8)
    y = TorchBatchAugment(prob=0.5, jitter=NO_JITTER)(x)
    ref = x.float() / 127.5 - 1.0
    which = [next(i for i, v in enumerate(_variants_of(r)) if torch.allclose(v, a, atol=1e-5)) for r, a in zip(ref, y)]
    assert (
        len(set(which)) >= 6
    )  # patches of one batch are flipped and turned differently (cuCIM's RandCuCIM: all alike)
    assert which.count(0) < 64


def test_batch_augment_on_a_cpu_says_once_why_not_cucim_and_refuses_a_forced_cucim(caplog):
    pathology_augment._told.clear()
    with caplog.at_level(logging.INFO, logger="monai_fast.apps.recipes.pathology_augment"):
        assert isinstance(batch_augment("cpu"), TorchBatchAugment)
        assert isinstance(batch_augment("cpu"), TorchBatchAugment)
    lines = [r.getMessage() for r in caplog.records if "instead of cuCIM" in r.getMessage()]
    assert len(lines) == 1 and ("not installed" in lines[0] or "CUDA GPU" in lines[0])
    with pytest.raises(RuntimeError, match="cuCIM GPU transforms asked for, but"):
        batch_augment("cpu", use_cucim=True)


def test_fast_pipeline_carries_the_levers_and_plain_does_not(patches):
    config = SIZES["tiny"].config(precision="fp32")
    fast = build_pathology("fast", *patches, config, "cpu")
    plain = build_pathology("plain", *patches, config, "cpu")
    assert isinstance(fast.trainer.data_loader, ThreadDataLoader) and not isinstance(
        plain.trainer.data_loader, ThreadDataLoader
    )
    assert isinstance(fast.trainer.optimizer, Novograd) and isinstance(plain.trainer.optimizer, torch.optim.SGD)
    assert isinstance(fast.trainer.prepare_batch, AugmentingPrepareBatch)
    assert isinstance(fast.trainer.prepare_batch.augment, TorchBatchAugment)  # no cuCIM on a CPU
    assert AMPToggle in handlers_on(fast.trainer) and AMPToggle not in handlers_on(plain.trainer)
    fast_reader = fast.trainer.data_loader.dataset.wsi_reader
    plain_reader = plain.trainer.data_loader.dataset.wsi_reader.reader  # MONAI's WSIReader(backend="tifffile")
    assert isinstance(fast_reader, TiledTiffWSIReader) or fast.notes["reader"].startswith("openslide")
    assert type(plain_reader) is TiffFileWSIReader
    assert fast.notes["augment"].startswith("torch batch ops on cpu (") and fast.notes["precision"] == "fp32"


def test_pathology_tutorial_trains_at_tiny_size(tmp_path):
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
        "--run-dir",
        str(tmp_path / "run"),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("GPU levers: cuCIM off: ")
    results = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    assert [r["variant"] for r in results] == ["fast"] and results[0]["epochs"] == 1 and results[0]["patches_per_s"] > 0
    assert 0.0 <= results[0]["best_auc"] <= 1.0 and math.isfinite(results[0]["final_acc"])
    assert (tmp_path / "run" / "fast" / "record.rank0.jsonl").is_file()  # RecordHandler: what monai-fast doctor reads
    assert "| fast | 1 |" in done.stdout


@pytest.mark.gpu
def test_cucim_path_augments_on_the_gpu_and_reads_what_the_tiled_reader_reads(patches):
    pytest.importorskip("cucim", reason="the cuCIM path needs cuCIM: pip install cucim-cu12")
    x = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, device="cuda")
    y = batch_augment("cuda", use_cucim=True)(x)
    assert isinstance(y, torch.Tensor) and y.device.type == "cuda" and y.dtype == torch.float32
    assert y.shape == x.shape and y.min() >= -1.0 and y.max() <= 1.0
    r = run_pathology("fast", *patches, SIZES["tiny"].config(max_epochs=1), "cuda", target=1.01)
    assert r["reader"].startswith("cucim") and r["augment"].startswith("cuCIM GPU kernels")
    assert r["precision"] in ("bf16", "fp16") and r["patches_per_s"] > 0


def test_both_pipelines_check_their_slides_and_guard_their_epochs(patches):
    from monai_fast.data.loaders import SafeThreadDataLoader
    from monai_fast.handlers.guards import EpochLengthGuard

    for variant in ("plain", "fast"):
        run = build_pathology(variant, *patches, SIZES["tiny"].config(precision="fp32"), "cpu")
        assert EpochLengthGuard in handlers_on(run.trainer) and EpochLengthGuard in handlers_on(run.evaluator)
    assert isinstance(run.trainer.data_loader, SafeThreadDataLoader) and run.notes["loader"].startswith(
        "SafeThreadDataLoader"
    )
