import copy
import math

import pytest
import torch
from monai.data import CacheDataset, Dataset, ThreadDataLoader
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.losses import DiceCELoss, DiceLoss
from monai.optimizers import Novograd

from monai_fast.apps.recipes import RECIPES, VAL_METRIC, RecipeConfig, build_recipe


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_trains_one_epoch(name, tiny_files, tiny_config):
    train, val = tiny_files
    recipe = build_recipe(name, train, val, tiny_config, "cpu", progress=False)
    assert isinstance(recipe.trainer, SupervisedTrainer) and isinstance(recipe.evaluator, SupervisedEvaluator)
    before = copy.deepcopy(recipe.network.state_dict())
    recipe.trainer.run()
    assert recipe.trainer.state.epoch == 1
    assert recipe.trainer.state.iteration == len(recipe.train_loader) == 2  # 4 cases, batch 2
    dice = recipe.evaluator.state.metrics[VAL_METRIC]
    assert math.isfinite(dice) and recipe.evaluator.state.iteration == len(val)  # every validation case scored
    after = recipe.network.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if after[k].is_floating_point())
    if name != "fast":
        assert recipe.amp is False  # MONAI's amp is CUDA-only
    assert recipe.notes


def test_baseline_is_plain_monai(tiny_files, tiny_config):
    r = build_recipe("baseline", *tiny_files, tiny_config, progress=False)
    assert type(r.train_loader.dataset) is Dataset
    assert r.train_loader.num_workers == tiny_config.num_workers
    assert isinstance(r.loss_function, DiceLoss) and isinstance(r.optimizer, torch.optim.Adam)
    assert r.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


@pytest.mark.parametrize("name", ["monai_tutorial", "fast"])
def test_cached_recipes_follow_monai_fast_training_guide(name, tiny_files, tiny_config):
    r = build_recipe(name, *tiny_files, tiny_config, progress=False)
    assert isinstance(r.train_loader, ThreadDataLoader) and r.train_loader.num_workers == 0
    assert isinstance(r.train_loader.dataset, CacheDataset)
    assert isinstance(r.loss_function, DiceCELoss)
    if name == "monai_tutorial":  # the guide's optimizer; fast measured AdamW better (docs/recipes.md)
        assert isinstance(r.optimizer, Novograd) and r.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
    else:
        assert isinstance(r.optimizer, torch.optim.AdamW) and r.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3)
    # the cache holds everything before the first random transform, as plain tensors with crop indices
    cached = r.train_loader.dataset._cache[0]
    assert type(cached["image"]) is torch.Tensor and "label_fg" in cached and "label_bg" in cached


@pytest.mark.parametrize("name, batch, crops", [("baseline", 2, 4), ("monai_tutorial", 2, 4), ("fast", 1, 2)])
def test_batch_and_crops_left_unset_take_the_recipes_own(name, batch, crops, tiny_files):
    cfg = RecipeConfig(patch_size=(32, 32, 32), max_epochs=1, num_workers=0, cache_threads=1)
    r = build_recipe(name, *tiny_files, cfg, progress=False)
    assert r.train_loader.batch_size == batch
    first = next(iter(r.train_loader))
    assert first["image"].shape[0] == batch * crops  # each volume gives `crops` random patches
    mine = build_recipe(
        name, *tiny_files, RecipeConfig(**{**cfg.to_dict(), "batch_size": 3, "num_samples": 1}), progress=False
    )
    assert mine.train_loader.batch_size == 3 and next(iter(mine.train_loader))["image"].shape[0] == 3
    assert cfg.batch_size is None and cfg.num_samples is None  # the caller's config is not changed


def test_with_defaults_fills_only_unset_options():
    cfg = RecipeConfig(batch_size=4)
    assert cfg.with_defaults(batch_size=1, num_samples=2).to_dict() == {**cfg.to_dict(), "num_samples": 2}
    with pytest.raises(ValueError, match="batchsize"):
        cfg.with_defaults(batchsize=1)


def test_fp16_request_on_cpu_warns_and_stays_fp32(tiny_files, tiny_config, caplog):
    cfg = RecipeConfig(**{**tiny_config.to_dict(), "precision": "fp16"})
    r = build_recipe("monai_tutorial", *tiny_files, cfg, progress=False)
    assert r.amp is False and "precision 'fp16' needs a CUDA device" in caplog.text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"patch_size": (30, 32, 32)}, "divisible"),
        ({"channels": (8, 16)}, "one more entry"),
        ({"batch_size": 0}, "batch_size"),
        ({"sw_overlap": 1.0}, "sw_overlap"),
        ({"intensity_window": (100, -100)}, "intensity_window"),
        ({"lr": -1.0}, "lr"),
    ],
)
def test_config_errors_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecipeConfig(**kwargs)


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="patchsize"):
        RecipeConfig.from_dict({"patchsize": (64, 64, 64)})
    assert RecipeConfig.from_dict({"batch_size": 3}).batch_size == 3


def test_unknown_recipe(tiny_files):
    with pytest.raises(ValueError, match="nnunet"):
        build_recipe("nnunet", *tiny_files)


def test_fast_in_fp32_differs_from_tutorial_only_in_memory_format(tiny_files, tiny_config):
    fp32 = RecipeConfig(**{**tiny_config.to_dict(), "precision": "fp32"})
    fast = build_recipe("fast", *tiny_files, fp32, progress=False)
    tut = build_recipe("monai_tutorial", *tiny_files, fp32, progress=False)
    assert not fast.amp and type(fast.trainer.inferer) is type(tut.trainer.inferer)
    conv = lambda net: next(m for m in net.modules() if isinstance(m, torch.nn.Conv3d) and m.in_channels > 1).weight  # noqa: E731
    assert conv(fast.network).is_contiguous(memory_format=torch.channels_last_3d)
    assert not conv(tut.network).is_contiguous(memory_format=torch.channels_last_3d)
    # the same weights at the same seed: only the layout differs
    for a, b in zip(fast.network.state_dict().values(), tut.network.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_fast_picks_its_precision_and_layout_together(tiny_files, tiny_config):
    from monai_fast.handlers.amp import _AutocastInferer

    r = build_recipe("fast", *tiny_files, tiny_config, progress=False)
    conv = next(m for m in r.network.modules() if isinstance(m, torch.nn.Conv3d) and m.in_channels > 1).weight
    if r.amp:  # bf16 measured faster on this CPU: autocast on trainer and evaluator, default layout
        evaluator_inferer = r.evaluator.inferer
        if not isinstance(evaluator_inferer, _AutocastInferer):  # FastTraining's prediction layout wraps it
            evaluator_inferer = evaluator_inferer.inner
        assert isinstance(r.trainer.inferer, _AutocastInferer) and isinstance(evaluator_inferer, _AutocastInferer)
        assert not conv.is_contiguous(memory_format=torch.channels_last_3d)
        assert "FastTraining precision: bf16" in " ".join(r.notes)
    else:
        assert conv.is_contiguous(memory_format=torch.channels_last_3d)
    r.trainer.run()
    assert math.isfinite(r.evaluator.state.metrics["val_mean_dice"]) and r.evaluator.state.iteration == len(
        tiny_files[1]
    )


def test_compile_option_reaches_monai_engines(tiny_files, tiny_config):
    cfg = RecipeConfig(**{**tiny_config.to_dict(), "compile": True})
    r = build_recipe("monai_tutorial", *tiny_files, cfg, progress=False)
    assert r.trainer.compile is True and r.evaluator.compile is True
    assert build_recipe("monai_tutorial", *tiny_files, tiny_config, progress=False).trainer.compile is False


def test_fast_caches_where_the_planner_says(tiny_files, tiny_config, tmp_path):
    from monai.data import CacheDataset, SmartCacheDataset

    from monai_fast.data.crop_cache import CropCacheDataset
    from monai_fast.handlers import SmartCacheUpdater
    from monai_fast.handlers.record import cached_dataset

    train, val = tiny_files
    base = tiny_config.to_dict()
    # plenty of RAM: a CacheDataset, as MONAI's guide does on a CPU
    r = build_recipe("fast", train, val, RecipeConfig(**base), "cpu", progress=False)
    assert type(r.train_loader.dataset) is CacheDataset
    assert any(n.startswith("FastTraining data: ram (") for n in r.notes), r.notes
    # a RAM budget of a few bytes and a cache folder: the disk cache that crops read by the patch, loaded by workers
    cfg = RecipeConfig(**{**base, "cache_budget_mib": 0.001, "cache_dir": str(tmp_path / "c")})
    r = build_recipe("fast", train, val, cfg, "cpu", progress=False)
    assert isinstance(r.train_loader.dataset, CropCacheDataset) and r.train_loader.dataset.reads_patches
    assert cached_dataset(r.trainer) == "CropCacheDataset"  # the record names it a cache
    assert r.train_loader.num_workers == cfg.loader_workers
    data_note = next(n for n in r.notes if n.startswith("FastTraining data: disk ("))  # the notes say what was built
    assert str(tmp_path / "c") in data_note and f"{cfg.loader_workers} worker processes" in data_note, data_note
    r.trainer.run()
    assert list((tmp_path / "c").glob("*/item.json"))  # the disk cache was written while training
    # forced SmartCache: the recipe drives its rotation itself
    r = build_recipe("fast", train, val, RecipeConfig(**{**base, "cache": "smartcache"}), "cpu", progress=False)
    assert isinstance(r.train_loader.dataset, SmartCacheDataset)
    assert any(isinstance(h, SmartCacheUpdater) for h in _handlers_of(r.trainer))
    r.trainer.run()


def _handlers_of(engine):
    return [getattr(h, "__self__", None) for hs in engine._event_handlers.values() for h, *_ in hs]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cache": "tape"}, "cache must be"),
        ({"cache": "disk"}, "needs cache_dir"),
        ({"cache_budget_mib": -1}, "cache_budget_mib"),
    ],
)
def test_cache_options_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecipeConfig(**kwargs)


def test_every_recipe_is_data_built_by_the_one_builder():
    import importlib
    import inspect
    import pkgutil

    import monai_fast.apps.recipes as recipes
    from monai_fast.apps.recipes import REGISTRY, RecipeSpec

    assert RECIPES == tuple(REGISTRY) == ("baseline", "monai_tutorial", "fast")
    assert all(type(spec) is RecipeSpec for spec in REGISTRY.values())
    # no recipe has a builder or parts function of its own: one of each serves the whole registry
    makers = {
        (inspect.signature(fn).return_annotation, name)
        for module in pkgutil.iter_modules(recipes.__path__, "monai_fast.apps.recipes.")
        if "pathology" not in module.name  # whole-slide classification stands outside the registry
        for name, fn in inspect.getmembers(importlib.import_module(module.name), inspect.isfunction)
        if fn.__module__ == module.name and not name.startswith("_")
    } | {(inspect.signature(fn).return_annotation, n) for n, fn in inspect.getmembers(recipes, inspect.isfunction)}
    assert {name for kind, name in makers if kind == "Recipe"} == {"build_recipe", "compose"}
    assert {name for kind, name in makers if kind == "RecipeParts"} == {"recipe_parts"}


@pytest.mark.parametrize("call", ["build_recipe", "recipe_parts"])
def test_an_unknown_recipe_is_named_before_any_work(call, tmp_path):
    import monai_fast.apps.recipes as recipes

    missing = [{"image": str(tmp_path / "absent.nii.gz"), "label": str(tmp_path / "absent_seg.nii.gz")}]
    args = ("fastest", missing, missing) if call == "build_recipe" else ("fastest",)
    with pytest.raises(
        ValueError, match=r"unknown recipe 'fastest'; choose one of \('baseline', 'monai_tutorial', 'fast'\)"
    ):
        getattr(recipes, call)(*args)


@pytest.mark.parametrize("name", RECIPES)
def test_parts_are_what_the_recipe_trains(name, tiny_files, tiny_config):
    from monai_fast.apps.recipes import recipe_parts

    cfg = RecipeConfig(**{**tiny_config.to_dict(), "precision": "fp32"})
    parts = recipe_parts(name, cfg, "cpu")
    r = build_recipe(name, *tiny_files, cfg, progress=False)
    net = parts.network()
    assert repr(net) == repr(r.network) and type(parts.loss()) is type(r.loss_function)
    assert type(parts.optimizer(net.parameters())) is type(r.optimizer)
    conv = lambda n: next(m for m in n.modules() if isinstance(m, torch.nn.Conv3d) and m.in_channels > 1).weight  # noqa: E731
    layout = torch.channels_last_3d
    assert conv(net).is_contiguous(memory_format=layout) == conv(r.network).is_contiguous(memory_format=layout)
    assert parts.channels_last == (name == "fast")
    names = lambda chain: [type(t).__name__ for t in chain.transforms]  # noqa: E731
    assert names(parts.train_transforms()) == names(r.train_loader.dataset.transform)
    assert (parts.config.batch_size, parts.config.num_samples) == (2, 2)  # the caller's values win over DEFAULTS


def test_fast_in_bf16_on_a_cpu_keeps_the_default_layout(monkeypatch):
    from monai_fast.apps.recipes import recipe_parts
    from monai_fast.telemetry import precision

    monkeypatch.setattr(precision, "cpu_has_bf16_hardware", lambda flags=None: True)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda rounds=3: 2.0)
    parts = recipe_parts("fast", RecipeConfig(), "cpu")
    assert parts.precision == "bf16" and not parts.channels_last and parts.precision_by == "toggle"


def test_fast_validates_on_a_schedule_and_only_a_full_validation_counts(tiny_files, tiny_config):
    from ignite.engine import Events

    from monai_fast.handlers import ValidationSchedule

    cfg = RecipeConfig(
        **{**tiny_config.to_dict(), "max_epochs": 3, "val_every": 2, "val_target": 0.99, "val_margin": 0.0}
    )
    r = build_recipe("fast", *tiny_files, cfg, progress=False)
    assert r.config.validation == "schedule"  # fast's default
    schedule = next(h for h in _handlers_of(r.trainer) if isinstance(h, ValidationSchedule))
    full_runs = []
    r.evaluator.add_event_handler(Events.COMPLETED, lambda e: full_runs.append(r.trainer.state.epoch))
    r.trainer.run()
    assert [e for e, _ in schedule.estimates] == [1, 2, 3]  # the estimate every epoch (the target stays far)
    assert (
        full_runs == schedule.full_epochs == [2, 3]
    )  # full: every val_every epochs and the last; no ValidationHandler
    assert len(schedule.estimator.data_loader.dataset) == min(cfg.val_subset, len(tiny_files[1]))
    assert build_recipe("monai_tutorial", *tiny_files, cfg, progress=False).config.validation is None  # every epoch


def test_a_bad_validation_option_is_named():
    with pytest.raises(ValueError, match="validation must be"):
        RecipeConfig(validation="sometimes")
    with pytest.raises(ValueError, match="val_every"):
        RecipeConfig(val_every=0)
