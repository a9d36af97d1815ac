"""One name per concept: precision, cache threads, cache places, budgets in MiB, the evaluator lever."""

from __future__ import annotations

import argparse
from typing import get_args

import pytest
from monai.data import DataLoader

from monai_fast.apps.cli.args import add_race_options
from monai_fast.apps.cli.race_cmds import race_spec
from monai_fast.apps.recipes import RecipeConfig, recipe_parts
from monai_fast.data.planner import CACHE_CHOICES, CACHE_PLACES, Where
from monai_fast.handlers import AMPToggle, FastTraining
from monai_fast.telemetry.precision import PRECISIONS, REQUESTS

# --- precision ---------------------------------------------------------------------------------------------


def test_the_precision_names_have_one_home():
    assert REQUESTS == ("auto", *PRECISIONS) and PRECISIONS == ("bf16", "fp16", "fp32")


def test_amptoggle_names_the_precisions_it_takes():
    with pytest.raises(ValueError, match="precision must be one of 'auto', 'bf16', 'fp16', 'fp32'"):
        AMPToggle(precision="fp8")


def test_recipe_config_round_trips():
    cfg = RecipeConfig(precision="bf16", cache_threads=3, max_epochs=7)
    assert RecipeConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown recipe option\(s\) \['amp'\]"):
        RecipeConfig.from_dict({**cfg.to_dict(), "amp": False})
    with pytest.raises(ValueError, match="precision must be one of"):
        RecipeConfig(precision="half")


def test_the_recipes_read_precision():
    assert recipe_parts("fast", RecipeConfig(precision="fp32")).precision == "fp32"
    assert recipe_parts("baseline", RecipeConfig()).precision == "fp32"
    assert recipe_parts("monai_tutorial", RecipeConfig(precision="fp32")).precision == "fp32"


def _race_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="monai-fast demo")
    add_race_options(p, budget=60.0, recipes=("fast",))
    return p


def test_cli_precision():
    p = _race_parser()
    assert next(a for a in p._actions if "--precision" in a.option_strings).choices is REQUESTS
    assert race_spec(p.parse_args(["--precision", "fp32"])).overrides["precision"] == "fp32"
    assert "precision" not in race_spec(p.parse_args([])).overrides
    bf16 = race_spec(p.parse_args(["--precision", "bf16"])).overrides
    assert RecipeConfig(**{k: v for k, v in bf16.items() if k in ("precision", "max_epochs")}).precision == "bf16"


# --- cache threads -----------------------------------------------------------------------------------------


def test_recipe_config_cache_threads():
    assert RecipeConfig(cache_threads=2).cache_thread_count == 2
    assert RecipeConfig().cache_thread_count >= 1
    from monai_fast.apps.recipes.assembly import fast_training

    ft = fast_training(recipe_parts("fast", RecipeConfig(precision="fp32", cache_threads=2)))
    assert ft.cache_threads == 2


# --- cache places ------------------------------------------------------------------------------------------


def test_the_cache_places_have_one_home():
    assert CACHE_PLACES == get_args(Where) == ("gpu", "ram", "disk", "smartcache", "none")
    assert CACHE_CHOICES == ("auto", *CACHE_PLACES)


def test_fast_training_recipe_config_and_cli_take_the_cache_choices():
    for choice in CACHE_CHOICES:
        FastTraining(cache=choice, cache_dir="/tmp/x")
        RecipeConfig(cache=choice, cache_dir="/tmp/x")
    expected = ", ".join(map(repr, CACHE_CHOICES))
    with pytest.raises(ValueError, match=f"cache must be one of {expected}"):
        FastTraining(cache="tape")
    with pytest.raises(ValueError, match=", ".join(CACHE_CHOICES)):
        RecipeConfig(cache="tape")
    p = _race_parser()
    assert next(a for a in p._actions if "--cache" in a.option_strings).choices is CACHE_CHOICES


# --- budgets -----------------------------------------------------------------------------------------------


def test_mib_budgets_plan_in_bytes(tiny_files, tiny_config):
    from monai.transforms import Compose

    from monai_fast.apps.recipes.transforms import deterministic_transforms
    from monai_fast.data.planner import plan_cache

    chain = Compose(deterministic_transforms(tiny_config))
    files = [dict(f) for f in tiny_files[0]]
    assert plan_cache(chain, files, "cpu", ram_budget_mib=1.0).budgets["ram"] == 2**20
    with pytest.raises(ValueError, match="ram_budget_mib must be >= 0"):
        plan_cache(chain, files, "cpu", ram_budget_mib=-1)


def test_adopt_loader_plans_within_its_mib_budgets(tiny_files, tiny_config):
    from monai.data import Dataset
    from monai.transforms import Compose

    from monai_fast.apps.recipes.transforms import deterministic_transforms
    from monai_fast.data.adopt import adopt_loader

    files = [dict(f) for f in tiny_files[0]]
    loader = DataLoader(Dataset(files, Compose(deterministic_transforms(tiny_config))), batch_size=1)
    assert adopt_loader(loader, ram_budget_mib=0.5, cache_threads=1).plan.budgets["ram"] == 2**19
    with pytest.raises(ValueError, match="disk_budget_mib must be >= 0"):
        adopt_loader(loader, disk_budget_mib=-1)


def test_the_tuners_space_takes_the_precision():
    from monai_fast.apps.recipes.tuning import default_space

    assert default_space("cpu", precision="fp32").precisions == ("fp32",)


# --- the evaluator lever -----------------------------------------------------------------------------------


def test_fast_training_takes_the_evaluator_lever():
    assert FastTraining(evaluator=False).evaluator_option is False
    with pytest.raises(ValueError, match="evaluator must be one of"):
        FastTraining(evaluator="later")


# --- precision through the tuner and the MONAI-amp recipes ---------------------------------------------------


def test_tuning_keeps_the_mixed_precision_the_config_asks_for():
    assert RecipeConfig(precision="bf16").tuned(2, 4, "cpu", "bf16").precision == "bf16"
    assert RecipeConfig(precision="auto").tuned(2, 4, "cpu", "bf16").precision == "auto"
    assert RecipeConfig(precision="fp32").tuned(2, 4, "cpu", "bf16").precision == "auto"
    assert RecipeConfig(precision="bf16").tuned(2, 4, "cpu", "fp32").precision == "fp32"


def test_fp16_on_a_cpu_is_named_before_a_race_starts(tmp_path):
    from monai_fast.apps.demo import RaceSpec
    from monai_fast.apps.demo.options import OptionError, plan_race

    spec = RaceSpec(recipes=("fast", "baseline"), device="cpu", overrides={"precision": "fp16"}, run_dir=tmp_path / "r")
    with pytest.raises(OptionError, match="precision.*'fp16' runs on a CUDA device only"):
        plan_race(spec)
    assert not (tmp_path / "r").exists()


def test_bf16_on_a_monai_amp_recipe_is_its_automatic_choice_with_one_warning(caplog):
    parts = recipe_parts("baseline", RecipeConfig(precision="bf16"), "cpu")
    auto = recipe_parts("baseline", RecipeConfig(precision="auto"), "cpu")
    assert parts.precision == auto.precision == "fp32"
    said = [r.getMessage() for r in caplog.records if "precision 'bf16'" in r.getMessage()]
    assert len(said) == 1 and "fp16 autocast only" in said[0], said
