"""Placing the training cache next to the tuned batch: the choice on known trials, and a real tuning run."""

from __future__ import annotations

import json

import pytest
import torch

from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.recipes.tuning import tune_recipe
from monai_fast.tune import SearchSpace, place_cache

FAST = {"warmup": 1, "min_iters": 1, "min_time_s": 0.0}


def _trials(curve: dict[int, tuple[float, float]], precision: str = "bf16") -> list[dict]:
    """Trial records shaped like ``TuneResult.trials``: {batch: (throughput, peak MiB)}."""
    out = [
        {"phase": "train", "precision": precision, "value": b, "feasible": True, "throughput": tp, "peak_mib": peak}
        for b, (tp, peak) in curve.items()
    ]
    out.append(
        {"phase": "train", "precision": precision, "value": 16, "feasible": False, "throughput": None, "peak_mib": None}
    )
    return out


CURVE = {2: (90.0, 3000.0), 4: (97.0, 5000.0), 6: (99.0, 7000.0), 8: (100.0, 9000.0)}


def test_cache_goes_to_device_memory_when_it_fits_beside_the_pick():
    choice = place_cache(
        _trials(CURVE),
        pick=8,
        precision="bf16",
        budget_mib=12000.0,
        cache_bytes=2500 * 2**20,
        device=torch.device("cuda"),
    )
    assert (choice.where, choice.batch_size, choice.budget_mib) == ("gpu", 8, 3000.0)
    assert choice.cache_mib == 2500.0 and "fits" in choice.reasons[-1]
    # the validation peak counts too: with a 10 GB validation peak only 2 GB are left
    choice = place_cache(
        _trials(CURVE),
        pick=8,
        precision="bf16",
        budget_mib=12000.0,
        cache_bytes=2500 * 2**20,
        device="cuda",
        val_peak_mib=10000.0,
    )
    assert choice.where == "ram" and choice.budget_mib == 2000.0


def test_a_smaller_batch_within_the_tradeoff_makes_room_for_the_cache():
    # 6 GB of cache: not beside 8 (3 GB left) nor 6 (5 GB); beside 4 (7 GB), 3 % slower than the pick
    choice = place_cache(
        _trials(CURVE),
        pick=8,
        precision="bf16",
        budget_mib=12000.0,
        cache_bytes=6000 * 2**20,
        device="cuda",
        tradeoff=0.05,
    )
    assert (choice.where, choice.batch_size, choice.budget_mib) == ("gpu", 4, 7000.0)
    assert "batch 4 instead: 3.0 % less" in choice.reasons[-1]


def test_no_trade_beyond_the_tradeoff_the_planner_decides():
    asked = []

    def plan_for(budget: int) -> str:
        asked.append(budget)
        return "ram"

    choice = place_cache(
        _trials(CURVE),
        pick=8,
        precision="bf16",
        budget_mib=12000.0,
        cache_bytes=6000 * 2**20,
        device="cuda",
        plan_for=plan_for,
        tradeoff=0.02,
    )  # batch 4 is 3 % slower: too much
    assert (choice.where, choice.batch_size) == ("ram", 8)
    assert asked == [3000 * 2**20]  # the planner got what is left beside the pick
    assert "no batch within 2 %" in choice.reasons[-1]


def test_on_a_cpu_device_memory_is_ram():
    choice = place_cache(
        _trials(CURVE), pick=8, precision="bf16", budget_mib=12000.0, cache_bytes=1000 * 2**20, device="cpu"
    )
    assert choice.where == "ram"
    choice = place_cache(
        _trials(CURVE),
        pick=8,
        precision="bf16",
        budget_mib=12000.0,
        cache_bytes=9000 * 2**20,
        device="cpu",
        tradeoff=0.0,
    )
    assert choice.where == "smartcache" and choice.batch_size == 8


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="batch size 16 has no feasible bf16"):
        place_cache(_trials(CURVE), pick=16, precision="bf16", budget_mib=1.0, cache_bytes=0, device="cpu")
    with pytest.raises(ValueError, match="batch size 8 has no feasible fp32"):
        place_cache(_trials(CURVE), pick=8, precision="fp32", budget_mib=1.0, cache_bytes=0, device="cpu")
    with pytest.raises(ValueError, match="tradeoff"):
        place_cache(_trials(CURVE), pick=8, precision="bf16", budget_mib=1.0, cache_bytes=0, device="cpu", tradeoff=1.0)


def test_real_tuning_places_the_cache_and_the_recipe_follows(tiny_files, tiny_config, tmp_path):
    from monai_fast.apps.recipes import build_recipe

    train, val = tiny_files
    space = SearchSpace(batch_range=(1, 2), sw_batch_range=(1, 2), max_trials=2, confirm=0)
    store = tmp_path / "tuning.json"
    result = tune_recipe(tiny_config, (32, 32, 32), space=space, store=store, train_files=train, **FAST)
    assert result.cache_where == "ram"  # a few MiB of cache, GiBs of RAM left
    peaks = [
        t["peak_mib"]
        for t in result.trials
        if t["feasible"]
        and (
            (t["phase"] == "train" and t["value"] == result.batch_size)
            or (t["phase"] == "val" and t["value"] == result.sw_batch_size)
        )
    ]
    assert result.cache_budget_mib == pytest.approx(result.budget_mib - max(peaks))
    assert "fits in RAM next to batch" in result.cache_reason and "cache: ram" in result.table()
    assert "|cache=4x" in result.key  # the data's size is part of the key
    stored = json.loads(store.read_text())[result.key]
    assert stored["cache_where"] == "ram"
    again = tune_recipe(tiny_config, (32, 32, 32), space=space, store=store, train_files=train, **FAST)
    assert again.from_cache and again.cache_budget_mib == result.cache_budget_mib
    without = tune_recipe(tiny_config, (32, 32, 32), space=space, store=store, **FAST)  # another key
    assert not without.from_cache and without.cache_where is None

    tuned = result.apply(tiny_config)
    assert tuned.cache_budget_mib == result.cache_budget_mib and tuned.batch_size == result.batch_size
    recipe = build_recipe(
        "fast", train, val, RecipeConfig.from_dict({**tuned.to_dict(), "max_epochs": 1}), "cpu", progress=False
    )
    assert any("cache in RAM" in n for n in recipe.notes), recipe.notes
    recipe.trainer.run()
    assert recipe.trainer.state.epoch == 1


@pytest.mark.gpu
def test_real_cuda_tuning_puts_a_small_cache_in_gpu_memory(tiny_files, tiny_config, tmp_path):
    train, _ = tiny_files
    space = SearchSpace(batch_range=(1, 2), sw_batch_range=(1, 2), max_trials=2, confirm=0)
    result = tune_recipe(
        tiny_config, (32, 32, 32), "cuda", space=space, store=tmp_path / "t.json", train_files=train, **FAST
    )
    assert result.cache_where == "gpu" and "fits in GPU next to batch" in result.cache_reason
    free_mib = torch.cuda.mem_get_info()[1] / 2**20
    assert 0 < result.cache_budget_mib < free_mib
