"""The SegResNet lab at --tiny, and the recipes' network choice (RecipeConfig.network)."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from monai.networks.nets import SegResNet, UNet
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from monai_fast.apps.recipes import VAL_METRIC, RecipeConfig, build_recipe, recipe_parts
from monai_fast.apps.recipes.parts import build_network
from monai_fast.tune.result import model_signature

LAB = Path(__file__).resolve().parents[1] / "tutorials" / "segresnet_lab.py"


def test_segresnet_lab_tiny_writes_tensorboard_scalars_and_images_a_figure_and_its_table(tmp_path):
    run = tmp_path / "lab"
    proc = subprocess.run(
        [sys.executable, str(LAB), "--tiny", "--device", "cpu", "--no-progress", "--run-dir", str(run)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    events = EventAccumulator(str(run / "fast"))
    events.Reload()
    scalars, images = events.Tags()["scalars"], events.Tags()["images"]
    for tag in ("train/loss", "epoch/loss", "val/mean_dice", "throughput/samples_per_s"):
        assert tag in scalars, (tag, scalars)
    for name in ("lab/input", "lab/label", "lab/prediction"):
        assert any(t.startswith(name) for t in images), (name, images)
    assert len(events.Scalars("val/mean_dice")) == 2  # one per epoch

    with Image.open(run / "prediction.png") as png:
        assert png.format == "PNG" and png.width > 300 and png.height > 100

    numbers = json.loads((run / "performance.json").read_text())
    assert numbers["epochs"] == 2 and numbers["time_per_epoch_s"] > 0
    assert numbers["network"].startswith("SegResNet")
    assert math.isfinite(numbers["final_dice"]) and numbers["peak_memory_mib"] > 0
    assert numbers["peak_memory_kind"] == "peak RSS (CPU)" and numbers["gpu_util_mean"] is None
    table = (run / "performance.md").read_text()
    for row in (
        "| time per epoch |",
        "| final validation Dice |",
        "| peak RSS (CPU) |",
        "| GPU utilisation | n/a (no GPU) |",
    ):
        assert row in table
    assert "| time per epoch |" in proc.stdout


def test_lab_network_option_builds_monais_segresnet_exactly():
    config = RecipeConfig(network="segresnet", channels=(16, 32, 64, 128), strides=(2, 2, 2), dropout=0.2)
    built = build_network(config, torch.device("cpu"))
    reference = SegResNet(spatial_dims=3, in_channels=1, out_channels=2, init_filters=16, dropout_prob=0.2)
    assert repr(built) == repr(reference)
    assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in reference.parameters())


def test_build_recipe_with_segresnet_trains_one_tiny_epoch(tiny_files, tiny_config):
    config = RecipeConfig(
        **{**tiny_config.to_dict(), "network": "segresnet", "channels": (8, 16, 32), "strides": (2, 2)}
    )
    recipe = build_recipe("fast", *tiny_files, config, "cpu", progress=False)
    assert isinstance(getattr(recipe.network, "module", recipe.network), SegResNet)
    before = copy.deepcopy(recipe.network.state_dict())
    recipe.trainer.run()
    assert recipe.trainer.state.epoch == 1
    assert math.isfinite(recipe.evaluator.state.metrics[VAL_METRIC])
    after = recipe.network.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if after[k].is_floating_point())


def test_the_tuners_model_signature_tells_the_networks_apart():
    unet = recipe_parts("fast", RecipeConfig(precision="fp32")).network()
    segresnet = recipe_parts("fast", RecipeConfig(precision="fp32", network="segresnet")).network()
    assert isinstance(unet, UNet) and isinstance(segresnet, SegResNet)
    assert model_signature(unet).startswith("UNet-") and model_signature(segresnet).startswith("SegResNet-")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"network": "vnet"}, r"network must be one of \('unet', 'segresnet'\), got 'vnet'"),
        (
            {"network": "segresnet", "channels": (12, 24), "strides": (2,)},
            r"network 'segresnet'.*channels must be like",
        ),
        ({"network": "segresnet", "channels": (8, 16, 64), "strides": (2, 2)}, r"channels must be like \(8, 16, 32\)"),
        (
            {"network": "segresnet", "channels": (8, 16), "strides": (3,), "patch_size": (24, 24, 24)},
            r"strides must all be 2",
        ),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_a_bad_network_option_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecipeConfig(**kwargs)
