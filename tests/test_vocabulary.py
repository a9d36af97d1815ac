"""One name per concept: precision, cache threads, cache places; each old name warns once and works."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path
from typing import get_args

import pytest
import torch
from monai.data import DataLoader
from monai.engines import SupervisedTrainer
from monai.losses import DiceLoss

from monai_fast.cli.args import add_race_options
from monai_fast.cli.race_cmds import race_spec
from monai_fast.data.planner import CACHE_CHOICES, CACHE_PLACES, Where
from monai_fast.handlers import AMPToggle, FastTraining
from monai_fast.recipes import RecipeConfig, recipe_parts
from monai_fast.telemetry.precision import PRECISIONS, REQUESTS

ROOT = Path(__file__).resolve().parents[1]


def _deprecations(fn, here: bool = True):
    """``fn()``'s result and the ``DeprecationWarning`` messages it raised (``here``: each pointing at this file)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    found = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert not here or all(w.filename == __file__ for w in found), [(w.filename, str(w.message)) for w in found]
    return result, [str(w.message) for w in found]


def _warns_once(fn, new: str, here: bool = True):
    result, messages = _deprecations(fn, here)
    assert len(messages) == 1 and new in messages[0] and "deprecated" in messages[0], messages
    return result


def _no_warning(fn):
    result, messages = _deprecations(fn)
    assert not messages, messages
    return result


# --- precision ---------------------------------------------------------------------------------------------


def test_the_precision_names_have_one_home():
    assert REQUESTS == ("auto", *PRECISIONS) and PRECISIONS == ("bf16", "fp16", "fp32")


def _trainer() -> SupervisedTrainer:
    torch.manual_seed(0)
    net = torch.nn.Conv3d(1, 2, 3, padding=1)
    data = [{"image": torch.rand(1, 8, 8, 8), "label": (torch.rand(1, 8, 8, 8) > 0.5).float()} for _ in range(2)]
    return SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=1,
        train_data_loader=DataLoader(data, batch_size=1),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_function=DiceLoss(to_onehot_y=True, softmax=True),
    )


def _trained_with(toggle: AMPToggle) -> tuple[dict, set]:
    trainer = _trainer()
    toggle.attach(trainer)
    seen: set = set()
    trainer.network.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    trainer.run()
    return toggle.state_dict(), seen


def test_amptoggle_dtype_warns_once_and_trains_as_precision():
    old = _warns_once(lambda: AMPToggle(dtype="bf16"), "AMPToggle(precision=...)")
    new = _no_warning(lambda: AMPToggle(precision="bf16"))
    assert old.requested == new.requested == "bf16"
    old_state, old_dtypes = _trained_with(old)
    new_state, new_dtypes = _trained_with(new)
    assert old_state == new_state and old_state["precision"] == "bf16"
    assert old_dtypes == new_dtypes == {torch.bfloat16}
    assert _no_warning(lambda: AMPToggle("fp32")).requested == "fp32"  # positional: the precision


def test_amptoggle_names_the_precisions_it_takes():
    with pytest.raises(ValueError, match="precision must be one of 'auto', 'bf16', 'fp16', 'fp32'"):
        AMPToggle(precision="fp8")
    with pytest.raises(ValueError, match="precision must be one of"):
        _warns_once(lambda: AMPToggle(dtype="fp8"), "AMPToggle(precision=...)")


@pytest.mark.parametrize("amp, precision", [(False, "fp32"), (True, "auto"), (None, "auto")])
def test_recipe_config_amp_warns_once_and_maps_onto_precision(amp, precision):
    old = _warns_once(lambda: RecipeConfig(amp=amp), "RecipeConfig(precision=...)")
    assert old == _no_warning(lambda: RecipeConfig(precision=precision))
    assert _warns_once(lambda: RecipeConfig.from_dict({"amp": amp}), "recipe option 'precision'") == old
    assert "amp" not in old.to_dict() and old.to_dict()["precision"] == precision


def test_recipe_config_amp_read_warns_once():
    cfg = RecipeConfig(precision="fp32")
    assert _warns_once(lambda: cfg.amp, "RecipeConfig.precision") is False
    assert _warns_once(lambda: RecipeConfig().amp, "RecipeConfig.precision") is None
    assert _warns_once(lambda: RecipeConfig(precision="bf16").amp, "RecipeConfig.precision") is True


def test_recipe_config_round_trips_and_loads_saved_amp():
    cfg = RecipeConfig(precision="bf16", cache_threads=3, max_epochs=7)
    assert _no_warning(lambda: RecipeConfig.from_dict(cfg.to_dict())) == cfg
    saved = {**RecipeConfig().to_dict(), "amp": False, "cache_workers": 2}
    del saved["precision"], saved["cache_threads"]
    loaded, messages = _deprecations(lambda: RecipeConfig.from_dict(saved))
    assert loaded == RecipeConfig(precision="fp32", cache_threads=2) and len(messages) == 2
    bf16 = RecipeConfig(precision="bf16")
    fp32 = _warns_once(lambda: dataclasses.replace(bf16, amp=False), "precision=...", here=False)
    assert fp32.precision == "fp32"  # the deprecated option, given with its successor, wins (as replace needs)
    with pytest.raises(ValueError, match="precision must be one of"):
        RecipeConfig(precision="half")


def test_a_results_file_written_with_amp_and_cache_workers_loads():
    saved = json.loads((ROOT / "benchmarks" / "results" / "inference_20261123-113542.json").read_text())["config"]
    assert "amp" in saved and "cache_workers" in saved
    loaded, messages = _deprecations(lambda: RecipeConfig.from_dict(saved))
    assert loaded.precision == "auto" and loaded.cache_threads is None and len(messages) == 2


def test_the_recipes_read_precision():
    assert recipe_parts("fast", RecipeConfig(precision="fp32")).precision == "fp32"
    assert recipe_parts("baseline", RecipeConfig()).precision == "fp32"
    assert recipe_parts("monai_tutorial", RecipeConfig(precision="fp32")).precision == "fp32"
    old = _warns_once(lambda: RecipeConfig(amp=False), "RecipeConfig(precision=...)")
    assert recipe_parts("fast", old).precision == "fp32"


def _race_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="monai-fast demo")
    add_race_options(p, budget=60.0, recipes=("fast",))
    return p


def test_cli_precision_and_the_fp32_alias(capsys):
    p = _race_parser()
    assert next(a for a in p._actions if "--precision" in a.option_strings).choices is REQUESTS
    new = p.parse_args(["--precision", "fp32"])
    assert capsys.readouterr().err == ""
    old = p.parse_args(["--fp32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--fp32 is deprecated" in err[0] and "--precision fp32" in err[0]
    assert vars(old) == vars(new)
    assert race_spec(old).overrides == race_spec(new).overrides and race_spec(new).overrides["precision"] == "fp32"
    assert "precision" not in race_spec(p.parse_args([])).overrides
    bf16 = race_spec(p.parse_args(["--precision", "bf16"])).overrides
    assert RecipeConfig(**{k: v for k, v in bf16.items() if k in ("precision", "max_epochs")}).precision == "bf16"


def test_bundle_fp32_alias(capsys):
    from monai_fast.cli.bundle_cmd import _own_options

    p = argparse.ArgumentParser(prog="monai-fast bundle run")
    _own_options(p)
    assert p.parse_args(["--fp32"]).precision == p.parse_args(["--precision", "fp32"]).precision == "fp32"
    assert capsys.readouterr().err.count("deprecated") == 1


def test_sagemaker_fp32_hyperparameter_still_means_fp32(capsys):
    from monai_fast.cli.train import hyperparameter_values

    assert hyperparameter_values({"fp32": True}, "SM_HPS") == {"precision": "fp32"}  # SM_HPS "true" is read as True
    assert hyperparameter_values({"precision": "fp32"}, "SM_HPS") == {"precision": "fp32"}


# --- cache threads -----------------------------------------------------------------------------------------


def test_recipe_config_cache_workers_warns_once_and_is_cache_threads():
    old = _warns_once(lambda: RecipeConfig(cache_workers=2), "RecipeConfig(cache_threads=...)")
    assert old == RecipeConfig(cache_threads=2) and old.cache_thread_count == 2
    assert _warns_once(lambda: old.cache_workers, "RecipeConfig.cache_threads") == 2
    assert RecipeConfig().cache_thread_count >= 1
    from monai_fast.recipes.fast import fast_training

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


def test_byte_budgets_warn_once_and_plan_as_their_mib_twins(tiny_files, tiny_config):
    from monai.transforms import Compose

    from monai_fast.data.planner import plan_cache
    from monai_fast.recipes.transforms import deterministic_transforms

    chain = Compose(deterministic_transforms(tiny_config))
    files = [dict(f) for f in tiny_files[0]]
    new = _no_warning(lambda: plan_cache(chain, files, "cpu", ram_budget_mib=1.0))
    old = _warns_once(lambda: plan_cache(chain, files, "cpu", ram_budget=2**20), "plan_cache(ram_budget_mib=MiB)")
    assert old.where == new.where and old.budgets == new.budgets and old.budgets["ram"] == 2**20
    with pytest.raises(TypeError, match="ram_budget_mib only"):
        _deprecations(lambda: plan_cache(chain, files, "cpu", ram_budget=1, ram_budget_mib=1))
    with pytest.raises(ValueError, match="ram_budget_mib must be >= 0"):
        plan_cache(chain, files, "cpu", ram_budget_mib=-1)


def test_adopt_loader_byte_budgets_warn_once_and_adopt_as_their_mib_twins(tiny_files, tiny_config):
    from monai.data import DataLoader, Dataset
    from monai.transforms import Compose

    from monai_fast.data.adopt import adopt_loader
    from monai_fast.recipes.transforms import deterministic_transforms

    files = [dict(f) for f in tiny_files[0]]
    loader = DataLoader(Dataset(files, Compose(deterministic_transforms(tiny_config))), batch_size=1)
    new = _no_warning(lambda: adopt_loader(loader, ram_budget_mib=0.5, cache_threads=1))
    old = _warns_once(
        lambda: adopt_loader(loader, ram_budget=2**19, cache_threads=1), "adopt_loader(ram_budget_mib=MiB)"
    )
    assert old.where == new.where and old.plan.budgets == new.plan.budgets and old.plan.budgets["ram"] == 2**19


def test_callers_of_the_old_names_keep_working():
    from monai_fast.recipes.tuning import default_space

    space = _warns_once(lambda: default_space("cpu", amp=False), "default_space(precision=...)")
    assert space.precisions == ("fp32",)
    assert _no_warning(lambda: default_space("cpu", precision="fp32")).precisions == ("fp32",)


# --- the evaluator lever -----------------------------------------------------------------------------------


def test_fast_training_validation_warns_once_and_is_evaluator():
    old = _warns_once(lambda: FastTraining(validation=False), "FastTraining(evaluator=...)")
    new = _no_warning(lambda: FastTraining(evaluator=False))
    assert old.evaluator_option is new.evaluator_option is False
    assert _warns_once(lambda: old.validation, "FastTraining.evaluator_option") is False
    with pytest.raises(ValueError, match="evaluator must be one of"):
        _deprecations(lambda: FastTraining(validation="later"))


# --- the old names through a race, the tuner and the MONAI-amp recipes ----------------------------------------


def test_a_race_takes_the_old_option_names_with_one_warning_each():
    from monai_fast.race.options import recipe_config

    config = _warns_once(lambda: recipe_config({"amp": False}, seed=1), "precision", here=False)
    assert config.precision == "fp32"
    assert (
        _warns_once(lambda: recipe_config({"cache_workers": 2}, seed=1), "cache_threads", here=False).cache_threads == 2
    )


def test_tuning_keeps_the_mixed_precision_the_config_asks_for():
    assert RecipeConfig(precision="bf16").tuned(2, 4, "cpu", "bf16").precision == "bf16"
    assert RecipeConfig(precision="auto").tuned(2, 4, "cpu", "bf16").precision == "auto"
    assert RecipeConfig(precision="fp32").tuned(2, 4, "cpu", "bf16").precision == "auto"
    assert RecipeConfig(precision="bf16").tuned(2, 4, "cpu", "fp32").precision == "fp32"


def test_fp16_on_a_cpu_is_named_before_a_race_starts(tmp_path):
    from monai_fast.race import RaceSpec
    from monai_fast.race.options import RaceOptionError, plan_race

    spec = RaceSpec(recipes=("fast", "baseline"), device="cpu", overrides={"precision": "fp16"}, run_dir=tmp_path / "r")
    with pytest.raises(RaceOptionError, match="precision.*'fp16' runs on a CUDA device only"):
        plan_race(spec)
    assert not (tmp_path / "r").exists()


def test_bf16_on_a_monai_amp_recipe_is_its_automatic_choice_with_one_warning(caplog):
    parts = recipe_parts("baseline", RecipeConfig(precision="bf16"), "cpu")
    auto = recipe_parts("baseline", RecipeConfig(precision="auto"), "cpu")
    assert parts.precision == auto.precision == "fp32"
    said = [r.getMessage() for r in caplog.records if "precision 'bf16'" in r.getMessage()]
    assert len(said) == 1 and "fp16 autocast only" in said[0], said


def test_the_tuners_old_names_warn_once_and_stay_listed():
    import monai_fast.tune as tune

    tune.__dict__.pop("default_space", None)
    assert {"default_space", "tune_recipe", "typical_val_shape"} <= set(dir(tune)) & set(tune.__all__)
    first = _warns_once(lambda: tune.default_space, "monai_fast.recipes.tuning.default_space")
    assert _no_warning(lambda: tune.default_space) is first
