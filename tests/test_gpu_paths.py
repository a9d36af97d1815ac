"""CUDA end to end: the ``fast`` recipe, the kernel profiler and FastTraining on a real GPU (skipped without one)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine

from monai_fast.apps.training.run import run_to_target
from monai_fast.handlers import FastTraining, KernelProfiler
from monai_fast.telemetry.record import Kind, Source, load_record, select

ROOT = Path(__file__).resolve().parent.parent


def _your_trainer_module():
    """``benchmarks/your_trainer.py``: the plain user trainer that FastTraining is measured on."""
    spec = importlib.util.spec_from_file_location("your_trainer", ROOT / "benchmarks" / "your_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
def test_fast_recipe_on_cuda_caches_on_the_gpu_trains_in_bf16_and_reaches_a_validation_dice(
    tiny_files, tiny_config, tmp_path
):
    r = run_to_target(
        "fast",
        *tiny_files,
        replace(tiny_config, max_epochs=3),
        "cuda",
        target=0.99,
        time_budget_s=300,
        run_dir=tmp_path,
        progress=False,
    )
    assert r.epochs_run == 3 and r.best_dice is not None and math.isfinite(r.best_dice) and r.best_dice > 0
    assert any("GPU memory" in n for n in r.notes), r.notes
    assert any(n.startswith("FastTraining precision: bf16") for n in r.notes), r.notes
    rows, _ = load_record(tmp_path / "fast")
    gpu = select(rows, Kind.INTERVAL, Source.GPU)
    assert gpu and all(0 <= g["gpu_util"] <= 100 and g["mem_used_mib"] > 0 for g in gpu)  # real NVML readings


@pytest.mark.gpu
def test_kernel_profiler_on_cuda_summarises_device_kernels_by_gpu_time(tmp_path):
    net = torch.nn.Conv3d(1, 8, 3).cuda()
    engine = Engine(lambda e, b: net(torch.randn(2, 1, 24, 24, 24, device="cuda")).sum().backward())
    KernelProfiler(tmp_path, wait=1, warmup=1, active=2).attach(engine)
    engine.run(list(range(6)), max_epochs=1)
    summary = json.loads((tmp_path / "kernels_rank0.json").read_text())
    assert summary["ranked_by"] == "gpu_time_ns"
    assert summary["All kernels"]["# Kernels"] > 0 and summary["All kernels"]["GPU Time (ns)"] > 0
    assert summary["top"][0]["gpu_time_ns"] >= summary["top"][-1]["gpu_time_ns"] > 0
    assert (tmp_path / "trace_rank0.json").stat().st_size > 0


@pytest.mark.gpu
def test_fast_training_on_cuda_caches_on_the_gpu_in_bf16_and_decides_the_memory_format(tiny_files):
    yt = _your_trainer_module()
    args = argparse.Namespace(seed=0, patch=(32, 32, 32), workers=0, channels=(4, 8, 16), epochs=1)
    trainer, evaluator = yt.build(tiny_files, args, "cuda")
    fast = FastTraining()
    fast.attach(trainer, evaluator)
    trainer.run()
    assert fast.applied["data"]["applied"] and fast.applied["data"]["setting"] == "gpu", fast.applied["data"]
    assert fast.applied["precision"]["setting"] == "bf16", fast.applied["precision"]
    fmt = fast.applied["memory_format"]
    assert fmt["setting"] in ("channels_last_3d", "contiguous") and fmt["reason"], fmt
    # a weight with one input channel or a 1x1x1 kernel is both layouts at once: look at one that is not
    conv = next(
        m
        for m in trainer.network.modules()
        if isinstance(m, torch.nn.Conv3d) and m.in_channels > 1 and m.weight.shape[2] > 1
    )
    assert conv.weight.is_contiguous(memory_format=torch.channels_last_3d) == (fmt["setting"] == "channels_last_3d")
    assert math.isfinite(evaluator.state.metrics["val_mean_dice"])


@pytest.mark.gpu
def test_fast_training_on_cuda_measures_a_long_plan_on_the_whole_batch_in_the_layout_it_keeps(tiny_files):
    from ignite.engine import Events

    yt = _your_trainer_module()
    args = argparse.Namespace(seed=0, patch=(32, 32, 32), workers=0, channels=(4, 8, 16), epochs=2000)
    trainer, evaluator = yt.build(tiny_files, args, "cuda")
    fast = FastTraining(tune_store=None)
    fast.attach(trainer, evaluator)
    # the layout's warm-ups and rounds on the run's own iterations, then the compile gate: stop once it decided
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: ("compile" in fast.applied or e.state.iteration >= 40) and e.terminate()
    )
    trainer.run()  # thousands of planned steps: the levers measure the run's own batch
    crops = trainer.data_loader.batch_size * 4  # RandCropByPosNegLabeld(num_samples=4)
    fmt, compiled = fast.applied["memory_format"], fast.applied["compile"]
    assert f"batch ({crops}, 1, 32, 32, 32))" in fmt["reason"] or fmt["reason"].endswith("(compiled)"), fmt
    if "batch" in compiled.get("evidence", {}):  # measured (a cold compile may not repay a tiny network)
        assert compiled["evidence"]["batch"][0] == crops, compiled
    conv = next(
        m
        for m in trainer.network.modules()
        if isinstance(m, torch.nn.Conv3d) and m.in_channels > 1 and m.weight.shape[2] > 1
    )
    assert conv.weight.is_contiguous(memory_format=torch.channels_last_3d) == (fmt["setting"] == "channels_last_3d")
