"""The auto-tuner: search logic, real trials on a tiny UNet, memory caps, real allocator failures, 2 gloo ranks."""

from __future__ import annotations

import gc
import json
import math
import random

import pytest
import torch
from ignite import distributed as idist
from monai.losses import DiceCELoss
from monai.networks.nets import UNet

from monai_fast.apps.launch import free_port
from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.recipes.tuning import tune_recipe
from monai_fast.tune import (
    SearchSpace,
    Trial,
    Tuner,
    TuningError,
    confirm_best,
    grow_then_bisect,
    pick_best,
)

FAST = {"warmup": 1, "min_iters": 1, "min_time_s": 0.0}


# ---------------------------------------------------------------- search logic on known curves
def _curve(knee: int, limit: int, drop: float = 0.0):
    """Throughput rising to a knee then flat (or falling by `drop` per step); infeasible from `limit`."""
    calls = []

    def f(v: int) -> Trial:
        calls.append(v)
        if v >= limit:
            return Trial(v, False, reason="out of memory")
        tp = 100.0 * min(v, knee) / knee - drop * max(0, v - knee)
        return Trial(v, True, tp, peak_mib=10.0 * v)

    return f, calls


def test_search_stops_at_memory_edge_and_plateau():
    f, calls = _curve(knee=8, limit=12)
    trials = grow_then_bisect(f, 1, 64, max_trials=10)
    assert pick_best(trials).value == 8
    assert calls[:7] == [1, 2, 4, 8, 16, 12, 10]  # doubling, then bisecting below the first infeasible value
    assert len(calls) <= 10

    f, calls = _curve(knee=6, limit=1000, drop=2.0)  # plateau, then slower: no OOM needed to stop
    trials = grow_then_bisect(f, 1, 512, max_trials=10)
    assert pick_best(trials).value == 6
    assert max(calls) <= 32  # one doubling past the first that did not gain, then no further


def test_search_is_within_5_percent_of_exhaustive_with_12_trials_and_mostly_with_8():
    rng = random.Random(0)
    runs = []
    for _ in range(200):
        knee, limit, hi = rng.randint(1, 40), rng.randint(2, 80), rng.randint(8, 64)
        drop = rng.choice([0.0, 0.5, 3.0])
        f, _ = _curve(knee, limit, drop)
        best_exhaustive = max(f(v).throughput for v in range(1, min(hi, limit - 1) + 1))
        ratios = []
        for budget in (8, 12):
            trials = grow_then_bisect(f, 1, hi, max_trials=budget, patience=0)  # noise-free: no second look
            assert sum(not t.predicted for t in trials) <= budget
            ratios.append(pick_best(trials).throughput / best_exhaustive)
        runs.append(ratios)
    # sharp knees and falling curves on ranges up to 64: 8 trials get within 5 % of the exhaustive
    # best on most curves and never below 75 %; 12 trials on all
    assert min(r[0] for r in runs) >= 0.75
    assert sum(r[0] >= 0.95 for r in runs) / len(runs) >= 0.85
    assert min(r[1] for r in runs) >= 0.95


def test_patience_survives_one_low_reading_on_the_way_up():
    base = {1: 20, 2: 36, 4: 60, 8: 80, 12: 87, 16: 92, 24: 95, 32: 97, 48: 98, 64: 99}

    def noisy(v: int) -> Trial:  # saturating throughput; the reading at 16 came out 12 % low
        tp = base.get(v, 100 * (1 - 0.8**v)) * (0.88 if v == 16 else 1.0)
        return Trial(v, True, tp)

    stopped = pick_best(grow_then_bisect(noisy, 1, 64, max_trials=8, patience=0))
    looked_on = pick_best(grow_then_bisect(noisy, 1, 64, max_trials=8, patience=1))
    assert stopped.value <= 16 and looked_on.value >= 32
    assert looked_on.throughput >= 0.97 * 99 > stopped.throughput


def test_growth_goes_on_after_a_low_reading_when_the_next_one_climbs():
    # the small preset's miss in benchmarks/README.md: 8 read 18 % low, 16 only 2 % above 4's reading,
    # though the curve still rises to 32
    readings = {1: 175.0, 2: 261.0, 4: 400.0, 8: 329.0, 16: 409.0, 32: 480.0}
    calls = []

    def read(v: int) -> Trial:
        calls.append(v)
        return Trial(v, True, readings.get(v, 400.0 + 2.5 * v))

    grow_then_bisect(read, 1, 32, max_trials=8, patience=1)
    assert 32 in calls  # judged against the best alone, 16 was a second miss and the growth stopped there


def test_predicted_infeasible_values_are_not_run():
    f, calls = _curve(knee=64, limit=10**6)
    trials = grow_then_bisect(f, 1, 1024, max_trials=20, predict_infeasible=lambda v, ts: "too big" if v > 40 else None)
    assert all(v <= 40 for v in calls)
    assert any(t.predicted and t.reason == "too big" for t in trials)
    assert pick_best(trials).value <= 40


def test_pick_prefers_smaller_within_noise():
    ts = [Trial(2, True, 100.0), Trial(4, True, 101.0), Trial(8, True, 90.0), Trial(16, False)]
    assert pick_best(ts, tie=0.02).value == 2
    assert pick_best(ts, tie=0.0).value == 4
    assert pick_best([Trial(1, False)]) is None


def test_confirm_best_takes_medians_and_drops_the_weakest():
    readings = {8: [28.0, 28.0], 6: [33.0, 33.0], 4: [30.0]}
    calls = []

    def again(v: int) -> Trial:
        calls.append(v)
        return Trial(v, True, readings[v].pop(0), peak_mib=float(v), cost_s=1.0)

    trials = [Trial(2, True, 20.0), Trial(4, True, 31.0), Trial(6, True, 32.0), Trial(8, True, 40.0)]  # 8: lucky
    finalists = confirm_best(trials, again, rounds=2, top=3)
    assert [t.value for t in finalists] == [6, 8]
    assert calls == [8, 6, 4, 8, 6]  # 3 candidates; then 4 is dropped and the two leaders go again, best first
    by = {t.value: t for t in trials}
    assert (by[8].throughput, by[6].throughput, by[4].throughput) == (28.0, 33.0, 30.5)
    assert by[6].reason == "median of 3 readings" and by[4].reason == "median of 2 readings"
    assert by[2].throughput == 20.0 and by[2].reason == ""  # not among the candidates measured again: untouched
    assert by[8].cost_s == 2.0
    assert pick_best(finalists).value == 6
    assert confirm_best(trials, again, rounds=0) == [] and calls == [8, 6, 4, 8, 6]  # rounds=0 runs nothing
    with pytest.raises(ValueError, match="top"):
        confirm_best(trials, again, top=1)


def test_confirm_best_marks_a_candidate_that_no_longer_fits():
    def again(v: int) -> Trial:
        return Trial(v, False, reason="out of memory") if v == 8 else Trial(v, True, 30.0, peak_mib=1.0)

    trials = [Trial(4, True, 30.0), Trial(8, True, 35.0)]
    assert [t.value for t in confirm_best(trials, again, rounds=2)] == [4]
    assert not trials[1].feasible and "out of memory" in trials[1].reason
    assert pick_best(trials).value == 4


def test_a_pick_among_finalists_ignores_an_unconfirmed_reading_within_the_tie():
    # 2 was read once, just within 2 % of the finalists' medians: the tie rule must not pick it
    readings = {4: [4.4, 4.5], 8: [4.6, 4.6], 16: [4.3]}
    trials = [
        Trial(1, True, 4.0),
        Trial(2, True, 4.52),
        Trial(4, True, 4.7),
        Trial(8, True, 4.8),
        Trial(16, True, 4.75),
    ]
    finalists = confirm_best(trials, lambda v: Trial(v, True, readings[v].pop(0)), rounds=2, top=3)
    assert pick_best(trials).value == 2  # what picking among all trials would do
    assert pick_best(finalists).value == 8


def test_search_runs_every_value_when_the_budget_covers_the_range():
    truth = {1: 50.0, 2: 60.0, 3: 62.0, 4: 61.0, 5: 75.0, 6: 62.0, 7: 61.0, 8: 60.0}  # a narrow peak at 5
    calls = []

    def read(v: int) -> Trial:
        calls.append(v)
        return Trial(v, v <= 7, truth[v] if v <= 7 else None)

    trials = grow_then_bisect(read, 1, 8, max_trials=8)
    assert calls == [1, 2, 3, 4, 5, 6, 7, 8] and pick_best(trials).value == 5
    calls.clear()
    grow_then_bisect(read, 1, 8, max_trials=7)  # the budget does not cover it: doubling skips 5
    assert 5 not in calls[:4] and calls[:4] == [1, 2, 4, 8]


def _noisy_reader(truth: dict[int, float], rng: random.Random):
    def read(v: int) -> Trial:
        return Trial(v, True, truth[v] * rng.uniform(0.85, 1.15))

    return read


def test_confirm_best_brings_noisy_picks_closer_to_the_best():
    """A flat-topped curve read with +-15 % noise (what a training step does on a 2-core VM): the
    confirmation rounds must raise the pick's true throughput on average, and how often it is within 5 %."""
    truth = {1: 60.0, 2: 80.0, 3: 90.0, 4: 95.0, 5: 100.0, 6: 97.0, 7: 94.0, 8: 90.0}
    truth.update({v: 90.0 - 3.0 * (v - 8) for v in range(9, 17)})
    with_confirm, without = [], []
    for seed in range(300):
        for rounds, out in ((2, with_confirm), (0, without)):
            read = _noisy_reader(truth, random.Random(seed))
            trials = grow_then_bisect(read, 1, 16, max_trials=8)
            finalists = confirm_best(trials, read, rounds=rounds)
            out.append(truth[pick_best(finalists or trials).value] / 100.0)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def within(xs: list[float]) -> float:
        return sum(x >= 0.95 for x in xs) / len(xs)

    assert mean(with_confirm) > mean(without) + 0.005
    assert within(with_confirm) > within(without) + 0.05


def test_search_space_validation_and_auto3dseg_keys():
    s = SearchSpace.from_auto3dseg(
        {"range_num_images_per_batch": [1, 20], "range_num_sw_batch_size": [2, 40], "num_trials": 5}
    )
    assert (s.batch_range, s.sw_batch_range, s.max_trials) == ((1, 20), (2, 40), 5)
    with pytest.raises(ValueError, match="range_num_foo"):
        SearchSpace.from_auto3dseg({"range_num_foo": [1, 2]})
    with pytest.raises(ValueError, match="batch_range"):
        SearchSpace(batch_range=(4, 2))
    with pytest.raises(ValueError, match="precisions"):
        SearchSpace(precisions=("int8",))
    with pytest.raises(ValueError, match="confirm_top"):
        SearchSpace(confirm_top=1)
    with pytest.raises(ValueError, match="fp16"):
        Tuner(_net(), _loss(), _sgd, (16, 16, 16), (24, 24, 24), space=SearchSpace(precisions=("fp16",)))


# ---------------------------------------------------------------- real trials
def _net(channels=(4, 8, 16)):
    return UNet(3, 1, 2, channels=channels, strides=(2,) * (len(channels) - 1), num_res_units=0)


def _loss():
    return DiceCELoss(to_onehot_y=True, softmax=True)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01)


class _GreedyNet(torch.nn.Module):
    """A real network whose forward asks the real allocator for an impossible buffer from `oom_at` patches on."""

    def __init__(self, oom_at: int, fail_with: type[Exception] | None = None) -> None:
        super().__init__()
        self.inner = _net()
        self.oom_at = oom_at
        self.fail_with = fail_with

    def forward(self, x):
        if x.shape[0] >= self.oom_at:
            if self.fail_with is not None:
                raise self.fail_with("shape bug in a custom layer")
            torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the CPU allocator refuses
        return self.inner(x)


def test_real_tuning_run_on_cpu(tmp_path):
    net = _net()
    weights = [p.detach().clone() for p in net.parameters()]
    tuner = Tuner(
        net,
        _loss(),
        _sgd,
        (16, 16, 16),
        (40, 40, 24),
        num_samples=2,
        space=SearchSpace(batch_range=(1, 8), sw_batch_range=(1, 8), max_trials=4),
        **FAST,
    )
    result = tuner.run()
    assert all(torch.equal(a, b) for a, b in zip(weights, net.parameters()))
    train = [t for t in result.trials if t["phase"] == "train"]
    val = [t for t in result.trials if t["phase"] == "val"]
    assert 1 <= len(train) <= 4 and 1 <= len(val) <= 4
    assert all(t["feasible"] and t["throughput"] > 0 and t["peak_mib"] > 0 for t in train + val)
    assert result.batch_size in {t["value"] for t in train}
    assert result.sw_batch_size in {t["value"] for t in val}
    assert result.val_device == "cpu" and result.precision == "fp32"
    picked = next(t for t in train if t["value"] == result.batch_size)
    assert result.train_samples_per_s == picked["throughput"]

    def readings(t: dict) -> int:
        return int(t["reason"].split()[2]) if t["reason"].startswith("median of") else 1

    # the confirmation rounds ran (3 candidates, 2 rounds) and the pick is a finalist: it has the most readings
    assert max(readings(t) for t in train) == 3 and readings(picked) == 3
    assert result.leak_mib < 64, result.leak_mib  # no trial's tensors outlive it
    table = result.table()
    assert "batch_size=" in table and "pick:" in table and "*" in table


def test_memory_cap_makes_big_batches_infeasible():
    import psutil

    space = SearchSpace(batch_range=(1, 16), sw_batch_range=(1, 1), max_trials=5, plateau=None)  # always grow
    free = Tuner(_net((8, 16, 32)), _loss(), _sgd, (48, 48, 48), (48, 48, 48), num_samples=2, space=space, **FAST).run()
    peaks = {t["value"]: t["peak_mib"] for t in free.trials if t["phase"] == "train"}
    assert peaks[16] > peaks[2] + 300, peaks  # activations grow with the batch
    # a budget three quarters of the way from batch 2's peak (or the RSS now, if higher) to batch 16's:
    # peaks grow about linearly with the batch, so 16 cannot fit and 8 (about 43 % of the way) should,
    # with room for the resident set to drift between the two runs
    low = max(peaks[2], psutil.Process().memory_info().rss / 2**20)
    cap = (low + 0.75 * (peaks[16] - low)) / 0.9
    capped = Tuner(
        _net((8, 16, 32)),
        _loss(),
        _sgd,
        (48, 48, 48),
        (48, 48, 48),
        num_samples=2,
        space=space,
        memory_cap_mib=cap,
        **FAST,
    ).run()
    train = {t["value"]: t for t in capped.trials if t["phase"] == "train"}
    over = sorted(v for v, t in train.items() if not t["feasible"])
    assert over and all("budget" in train[v]["reason"] for v in over), train  # measured or predicted over budget
    assert train[1]["feasible"] and train[2]["feasible"]
    assert capped.batch_size < over[0]
    assert train[capped.batch_size]["peak_mib"] <= capped.budget_mib


def test_real_allocator_failure_is_infeasible_and_search_goes_on():
    net = _GreedyNet(oom_at=8)  # batch_size 4 x 2 samples = 8 patches fails
    tuner = Tuner(
        net,
        _loss(),
        _sgd,
        (16, 16, 16),
        (24, 24, 24),
        num_samples=2,
        space=SearchSpace(batch_range=(1, 16), sw_batch_range=(1, 2), max_trials=6, plateau=None),
        **FAST,
    )
    result = tuner.run()
    train = {t["value"]: t for t in result.trials if t["phase"] == "train"}
    assert train[4]["reason"] == "out of memory" and not train[4]["feasible"]
    assert 3 in train and train[3]["feasible"]  # bisected back below the failure
    assert result.batch_size <= 3
    assert result.leak_mib < 64


def test_other_errors_stop_tuning_naming_the_candidate():
    tuner = Tuner(
        _GreedyNet(oom_at=4, fail_with=IndexError),
        _loss(),
        _sgd,
        (16, 16, 16),
        (24, 24, 24),
        num_samples=2,
        space=SearchSpace(batch_range=(1, 8), sw_batch_range=(1, 2), max_trials=4, plateau=None),
        **FAST,
    )
    with pytest.raises(TuningError, match=r"trial 2 failed.*IndexError: shape bug"):
        tuner.run()


def test_nothing_fits_is_a_clear_error():
    tuner = Tuner(
        _GreedyNet(oom_at=1),
        _loss(),
        _sgd,
        (16, 16, 16),
        (24, 24, 24),
        space=SearchSpace(batch_range=(1, 4), sw_batch_range=(1, 2)),
        **FAST,
    )
    with pytest.raises(TuningError, match=r"no training batch size in \(1, 4\) fits.*out of memory"):
        tuner.run()


def test_store_caches_by_key_and_survives_damage(tmp_path, caplog):
    cfg = RecipeConfig(patch_size=(16, 16, 16), channels=(4, 8), strides=(2,), num_samples=1)
    space = SearchSpace(batch_range=(1, 2), sw_batch_range=(1, 2), max_trials=2)
    path = tmp_path / "tuning.json"
    first = tune_recipe(cfg, (24, 24, 24), space=space, store=path, **FAST)
    assert not first.from_cache and path.exists()
    again = tune_recipe(cfg, (24, 24, 24), space=space, store=path, **FAST)
    assert again.from_cache and again.batch_size == first.batch_size and again.trials == first.trials
    other = tune_recipe(cfg, (32, 32, 32), space=space, store=path, **FAST)  # another volume: another key
    assert not other.from_cache
    assert len(json.loads(path.read_text())) == 2
    path.write_text('{"truncated": ')
    fresh = tune_recipe(cfg, (24, 24, 24), space=space, store=path, **FAST)
    assert not fresh.from_cache
    assert "unreadable" in caplog.text and str(path) in caplog.text
    assert (tmp_path / "tuning.json.damaged").exists()


def test_tuned_config_trains_with_a_recipe(tiny_files, tiny_config):
    from monai_fast.apps.recipes import build_recipe

    cfg = tiny_config
    result = tune_recipe(
        cfg,
        (32, 32, 32),
        space=SearchSpace(batch_range=(1, 2), sw_batch_range=(1, 4), max_trials=2),
        store=None,
        force=True,
        **FAST,
    )
    tuned = result.apply(cfg)
    assert (tuned.batch_size, tuned.sw_batch_size, tuned.val_device) == (result.batch_size, result.sw_batch_size, "cpu")
    train, val = tiny_files
    recipe = build_recipe(
        "fast", train, val, RecipeConfig.from_dict({**tuned.to_dict(), "max_epochs": 1}), "cpu", progress=False
    )
    recipe.trainer.run()
    assert math.isfinite(recipe.evaluator.state.metrics["val_mean_dice"]) and recipe.evaluator.state.iteration == len(
        val
    )
    assert recipe.evaluator.inferer.sw_batch_size == result.sw_batch_size


# ---------------------------------------------------------------- two real gloo ranks
def _ddp_tune(local_rank, out_dir, fail_with):
    rank = idist.get_rank()
    # rank 1 alone runs out of memory (or hits a bug) from 8 patches on; rank 0 would fit anything
    net = _GreedyNet(oom_at=8 if rank == 1 else 10**9, fail_with=fail_with if rank == 1 else None)
    torch.manual_seed(0)
    tuner = Tuner(
        net,
        _loss(),
        _sgd,
        (16, 16, 16),
        (24, 24, 24),
        num_samples=2,
        space=SearchSpace(batch_range=(1, 16), sw_batch_range=(1, 2), max_trials=6, plateau=None),
        **FAST,
    )
    try:
        r = tuner.run()
        out = {
            "batch_size": r.batch_size,
            "sw": r.sw_batch_size,
            "train": [(t["value"], t["feasible"], t["reason"]) for t in r.trials if t["phase"] == "train"],
        }
    except TuningError as e:
        out = {"error": str(e)}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)


@pytest.mark.parametrize("fail_with", [None, KeyError])
def test_two_gloo_ranks_agree_on_infeasible_candidates(tmp_path, fail_with):
    # spawn, not fork: this process has already run torch's thread pools, which a forked child can deadlock on
    with idist.Parallel(backend="gloo", nproc_per_node=2, master_port=free_port(), start_method="spawn") as parallel:
        parallel.run(_ddp_tune, str(tmp_path), fail_with)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    if fail_with is None:
        assert r0 == r1  # same candidates, same verdicts, same pick
        train = {v: (ok, why) for v, ok, why in r0["train"]}
        assert train[4] == (False, "out of memory")  # rank 1's OOM makes it infeasible on rank 0 too
        assert r0["batch_size"] <= 3
    else:
        for r in (r0, r1):
            assert "rank 1: KeyError" in r["error"] and "trial 4 failed" in r["error"]


# ---------------------------------------------------------------- CUDA
@pytest.mark.gpu
def test_real_cuda_oom_is_infeasible_and_memory_returns():
    dev = torch.device("cuda")
    gc.collect()  # tensors an earlier test left in cycles would otherwise be freed inside the tuner
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    total_gib = torch.cuda.get_device_properties(dev).total_memory / 2**30
    # 128^3 patches of a wide UNet: a few hundred per batch exceed any GPU; the cap stays off to force a real OOM
    net = UNet(3, 1, 2, channels=(32, 64, 128, 256), strides=(2, 2, 2), num_res_units=1)
    tuner = Tuner(
        net,
        _loss(),
        _sgd,
        (128, 128, 128),
        (160, 160, 128),
        device=dev,
        space=SearchSpace(batch_range=(1, 4096), sw_batch_range=(1, 4), max_trials=14, plateau=None, margin=0.0),
        memory_cap_mib=10 * total_gib * 2**10,
        **FAST,
    )
    result = tuner.run()
    train = [t for t in result.trials if t["phase"] == "train"]
    assert any(t["reason"] == "out of memory" for t in train), train
    assert any(t["feasible"] for t in train)
    assert result.batch_size < min(t["value"] for t in train if t["reason"] == "out of memory")
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(dev) == base
    assert math.isfinite(result.train_samples_per_s)


def test_tune_recipe_times_the_recipes_own_network_layout(tmp_path, monkeypatch):
    from monai_fast.apps.recipes import recipe_parts

    seen = []
    real = Tuner.run

    def spy(self, progress=False):
        seen.append(self)
        return real(self, progress)

    monkeypatch.setattr(Tuner, "run", spy)
    cfg = RecipeConfig(patch_size=(16, 16, 16), channels=(4, 8), strides=(2,), num_samples=1, precision="fp32")
    space = SearchSpace(batch_range=(1, 1), sw_batch_range=(1, 1), max_trials=1, confirm=0)
    result = tune_recipe(cfg, (24, 24, 24), space=space, store=tmp_path / "t.json", **FAST)
    tuner = seen[0]
    parts = recipe_parts("fast", cfg, "cpu")
    assert repr(tuner.source_network) == repr(parts.network()) and type(tuner.loss_function) is type(parts.loss())
    conv = next(m for m in tuner.source_network.modules() if isinstance(m, torch.nn.Conv3d) and m.in_channels > 1)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last_3d)  # fast's fp32 layout
    assert "layout=channels_last_3d" in result.key
    assert type(tuner.optimizer_factory(torch.nn.Linear(1, 1).parameters())) is torch.optim.AdamW
    assert result.is_pick(result.picked("train")) and result.picked("val")["phase"] == "val"
