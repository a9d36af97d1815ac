"""The demo's size is a pure function of the device: spleen-scale with MONAI's tutorial UNet on CUDA, small on a CPU."""

from __future__ import annotations

import pytest
import torch

from monai_fast.apps.cli import build_parser
from monai_fast.apps.cli.race_cmds import race_spec
from monai_fast.apps.demo.options import RaceSpec, SyntheticData, size_line
from monai_fast.apps.training.data import demo_scale
from monai_fast.apps.training.options import recipe_config


@pytest.fixture
def no_cuda_calls(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("demo_scale called CUDA")

    for name in ("is_available", "device_count", "get_device_properties", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_cuda_device_gets_a_spleen_scale_set_and_the_tutorial_unet_without_any_cuda_call(no_cuda_calls):
    scale = demo_scale(torch.device("cuda"))
    assert scale.synthetic == SyntheticData(kind="spleen-like", cases=40, shape=(240, 240, 96))
    assert scale.overrides == {
        "patch_size": (96, 96, 96),
        "channels": (16, 32, 64, 128, 256),
        "strides": (2, 2, 2, 2),
        "num_res_units": 2,
    }
    line = size_line(RaceSpec(synthetic=scale.synthetic, overrides=scale.overrides), scale)
    assert line.startswith(
        "sized for cuda (default: spleen-scale (like Task09 Spleen after resampling), MONAI's tutorial UNet): "
        "40 synthetic volumes of 240x240x96 voxels, 96x96x96 patches, UNet 16-32-64-128-256 with 2 residual"
    )
    config = recipe_config(scale.overrides, seed=0)  # valid recipe options
    assert config.num_res_units == 2 and config.patch_size == (96, 96, 96)


def test_cpu_device_keeps_the_small_default(no_cuda_calls):
    scale = demo_scale(torch.device("cpu"))
    assert scale.synthetic == SyntheticData(cases=16, shape=(128, 128, 64)) and scale.overrides == {}
    assert size_line(RaceSpec(), scale).startswith(
        "sized for cpu (default: small, for a CPU): 16 synthetic volumes of 128x128x64"
    )


def test_demo_options_left_unset_take_the_devices_scale_and_set_ones_win():
    parse = build_parser().parse_args
    spec = race_spec(parse(["demo"]), "runs/x", demo_scale(torch.device("cuda")))
    assert (
        spec.synthetic.cases == 40
        and spec.overrides["num_res_units"] == 2
        and spec.overrides["patch_size"] == (96, 96, 96)
    )
    spec = race_spec(
        parse(["demo", "--cases", "8", "--channels", "8", "16"]), "runs/x", demo_scale(torch.device("cuda"))
    )
    assert spec.synthetic == SyntheticData(cases=8, shape=(240, 240, 96))
    assert (
        spec.overrides["channels"] == (8, 16)
        and spec.overrides["strides"] == (2,)
        and "num_res_units" not in spec.overrides
    )
    spec = race_spec(parse(["bench"]), "runs/x")  # bench and tune: the CPU-sized defaults on any device
    assert spec.synthetic == SyntheticData() and "num_res_units" not in spec.overrides


def test_the_overlaps_can_be_switched_from_the_command_line():
    from monai_fast.apps.cli import build_parser
    from monai_fast.apps.recipes import RecipeConfig

    parse = build_parser().parse_args
    on = race_spec(parse(["bench", "--background-fill"]), "runs/x").overrides
    off = race_spec(parse(["bench", "--validation", "every_epoch"]), "runs/x").overrides
    assert on["background_fill"] is True and "validation" not in on  # the recipe's own default (fast: schedule)
    assert off["validation"] == "every_epoch" and "background_fill" not in off
    assert RecipeConfig(**off).validation == "every_epoch"
