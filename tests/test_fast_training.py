"""FastTraining on a trainer written the way MONAI's spleen tutorial writes it, on real NIfTI files."""

from __future__ import annotations

import inspect
import json
import logging
import math
import time

import pytest
import torch
from ignite.engine import Events
from monai.data import CacheDataset, DataLoader, Dataset, list_data_collate
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import MeanDice, ValidationHandler, from_engine
from monai.inferers import SlidingWindowInferer
from monai.losses import DiceLoss
from monai.networks.nets import UNet
from monai.transforms import (
    AsDiscreted,
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandCropByPosNegLabeld,
    RandFlipd,
    ScaleIntensityRanged,
    Spacingd,
)
from monai.utils import set_determinism
from torch.utils.data import TensorDataset

from monai_fast.apps.launch import free_port
from monai_fast.data.loaders import SafeThreadDataLoader
from monai_fast.handlers import FastTraining, NonFiniteGuard, PrefetchChoice, RecordHandler, TimeBreakdown
from monai_fast.handlers.lifecycle import handlers_on
from monai_fast.telemetry.record import Kind, Lever, Source, load_record, select

PATCH = (16, 16, 16)


def _chain(random: bool) -> Compose:
    keys = ["image", "label"]
    t = [
        LoadImaged(keys=keys),
        EnsureChannelFirstd(keys=keys),
        Orientationd(keys=keys, axcodes="RAS"),
        Spacingd(keys=keys, pixdim=(3.0, 3.0, 4.0), mode=("bilinear", "nearest")),
        ScaleIntensityRanged(keys="image", a_min=-57, a_max=164, b_min=0.0, b_max=1.0, clip=True),
        CropForegroundd(keys=keys, source_key="image", allow_smaller=True),
    ]
    if random:
        t += [
            RandCropByPosNegLabeld(keys=keys, label_key="label", spatial_size=PATCH, pos=1, neg=1, num_samples=2),
            RandFlipd(keys=keys, prob=0.5, spatial_axis=0),
        ]
    return Compose(t)


def _user_trainer(files, seed=0, train_loader=None, network=None, max_epochs=1):
    """A plain MONAI trainer + evaluator, as in MONAI's spleen tutorial (tiny sizes)."""
    set_determinism(seed)
    train_files, val_files = files
    loader = train_loader or DataLoader(
        Dataset(train_files, _chain(True)), batch_size=2, shuffle=True, num_workers=0, collate_fn=list_data_collate
    )
    val_loader = DataLoader(Dataset(val_files, _chain(False)), batch_size=1, num_workers=0)
    net = network or UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8), strides=(2,), num_res_units=0)
    post = Compose([AsDiscreted(keys="pred", argmax=True, to_onehot=2), AsDiscreted(keys="label", to_onehot=2)])
    evaluator = SupervisedEvaluator(
        device="cpu",
        val_data_loader=val_loader,
        network=net,
        inferer=SlidingWindowInferer(PATCH, sw_batch_size=2),
        postprocessing=post,
        key_val_metric={
            "val_mean_dice": MeanDice(include_background=False, output_transform=from_engine(["pred", "label"]))
        },
    )
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=max_epochs,
        train_data_loader=loader,
        network=net,
        optimizer=torch.optim.Adam(net.parameters(), 1e-4),
        loss_function=DiceLoss(to_onehot_y=True, softmax=True),
        train_handlers=[ValidationHandler(validator=evaluator, interval=1)],
    )
    return trainer, evaluator


def _crops(trainer):
    seen = []

    def grab(engine):
        batch = engine.state.batch
        seen.append(
            (
                tuple(batch["image"].shape),
                round(float(batch["image"].double().sum()), 6),
                tuple(str(f) for f in batch["image"].meta["filename_or_obj"]),
            )
        )

    trainer.add_event_handler(Events.ITERATION_STARTED, grab)
    return seen


def test_one_attach_replaces_both_loaders_and_records_what_it_applied(tiny_files, tmp_path):
    trainer, evaluator = _user_trainer(tiny_files)
    before = (trainer.state.epoch_length, len(evaluator.data_loader))
    rec = RecordHandler(tmp_path)
    rec.attach(trainer)
    rec.attach(evaluator)
    TimeBreakdown().attach(trainer)
    fast = FastTraining()
    fast.attach(trainer, evaluator)
    assert isinstance(trainer.data_loader, SafeThreadDataLoader) and isinstance(
        trainer.data_loader.dataset, CacheDataset
    )
    assert isinstance(evaluator.data_loader, SafeThreadDataLoader) and isinstance(
        evaluator.data_loader.dataset, CacheDataset
    )
    assert (trainer.state.epoch_length, len(evaluator.data_loader)) == before
    assert trainer.data_loader.batch_size == 2 and trainer.data_loader.collate_fn is list_data_collate
    trainer.run()
    assert math.isfinite(evaluator.state.metrics["val_mean_dice"]) and evaluator.state.iteration == len(tiny_files[1])
    assert fast.applied["data"]["applied"] and fast.applied["data"]["setting"] == "ram"
    assert fast.applied["precision"]["setting"] in ("bf16", "fp32") and "memory_format" in fast.applied
    rows, summary = load_record(tmp_path)
    levers = {r["lever"]: r for r in select(rows, Kind.EVENT, Source.FAST_TRAINING)}
    assert set(levers) == {lever.value for lever in Lever}  # every lever, each once
    options = set(inspect.signature(FastTraining).parameters)
    assert {"precision", "memory_format", "evaluator", "prefetch", "prediction_layout"} <= set(levers) & options
    assert "validation" not in levers  # the sliding-window lever is named as its option, evaluator
    assert summary["fast_training"]["data"]["setting"] == "ram"
    fills = [r for r in rows if r["kind"] == "span" and r["category"] == "cache_fill"]
    assert len(fills) == 2 and all(
        r["duration_s"] > 0 and not r["overlapped"] for r in fills
    )  # in the doctor's wall clock
    # the doctor never recommends what is already on, and says what is
    from monai_fast.report.advice import FIXES
    from monai_fast.report.doctor import doctor

    d = doctor(tmp_path)
    for lever, text in FIXES[d.verdict]:
        if lever is not None and fast.applied.get(lever, {}).get("applied"):
            assert text not in d.fixes, (d.verdict, text)
    assert "FastTraining data: ram" in (tmp_path / "report.md").read_text()


def test_a_data_bound_verdict_after_fast_training_does_not_recommend_caching_again():
    from monai_fast.report.doctor import diagnose

    rows = [
        {
            "kind": "epoch",
            "source": "time_breakdown",
            "engine": "train",
            "epoch": 1,
            "iterations": 4,
            "data_s": 5.0,
            "compute_s": 5.0,
        },
        {"kind": "event", "source": "fast_training", "lever": "data", "applied": True, "setting": "ram", "reason": "x"},
    ]
    d = diagnose(rows)
    assert d.verdict == "data-bound"
    assert (
        not any("FastTraining(cache='auto')" in f for f in d.fixes)
        and "already applied by FastTraining: data (ram)" in d.fixes
    )
    d_without = diagnose(rows[:1])
    assert any("FastTraining(cache='auto')" in f for f in d_without.fixes)


def test_the_same_crops_as_the_users_own_loader_for_the_same_seed(tiny_files):
    plain, _ = _user_trainer(tiny_files, seed=3, max_epochs=2)
    want = _crops(plain)
    plain.run()
    fast_trainer, fast_eval = _user_trainer(tiny_files, seed=3, max_epochs=2)
    got = _crops(fast_trainer)
    FastTraining().attach(fast_trainer, fast_eval)
    fast_trainer.run()
    assert len(want) == len(got) == 2 * plain.state.epoch_length
    assert got == want


def test_what_cannot_be_applied_is_left_alone_with_a_reason_and_the_rest_applies(tiny_files, caplog):
    class RejectsChannelsLast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv3d(1, 2, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            if y.is_contiguous(memory_format=torch.channels_last_3d) and not y.is_contiguous():
                raise RuntimeError("this network needs contiguous activations")
            return y

    tensors = TensorDataset(torch.rand(4, 1, *PATCH), torch.randint(0, 2, (4, 1, *PATCH)).float())
    plain_loader = torch.utils.data.DataLoader(
        tensors,
        batch_size=2,
        collate_fn=lambda b: {"image": torch.stack([x for x, _ in b]), "label": torch.stack([y for _, y in b])},
    )
    trainer, evaluator = _user_trainer(tiny_files, train_loader=plain_loader, network=RejectsChannelsLast())
    fast = FastTraining(memory_format="channels_last_3d")
    with caplog.at_level(logging.INFO, logger="monai_fast.handlers"):
        fast.attach(trainer, evaluator)
        trainer.run()
    assert not fast.applied["data"]["applied"] and "no .data and .transform" in fast.applied["data"]["reason"]
    assert fast.applied["validation data"]["applied"]  # the evaluator's MONAI loader still adopted
    assert (
        not fast.applied["memory_format"]["applied"]
        and "rejects channels_last_3d" in fast.applied["memory_format"]["reason"]
    )
    assert "FastTraining data: left alone: the data set (TensorDataset)" in caplog.text
    assert trainer.state.epoch == 1


def test_an_unknown_collate_function_is_refused_unless_thread_is_asked_for(tiny_files):
    def my_collate(batch):
        return list_data_collate(batch)

    ds = Dataset(tiny_files[0], _chain(True))
    for loader_option, adopted in (("auto", False), ("thread", True)):
        trainer, evaluator = _user_trainer(tiny_files, train_loader=DataLoader(ds, batch_size=2, collate_fn=my_collate))
        fast = FastTraining(loader=loader_option, precision=False, memory_format=False)
        fast.attach(trainer, evaluator)
        assert fast.applied["data"]["applied"] is adopted, fast.applied["data"]
        assert NonFiniteGuard in handlers_on(trainer), "non-finite losses are guarded also with precision=False"
        assert isinstance(trainer.data_loader, SafeThreadDataLoader) is adopted


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="cache"):
        FastTraining(cache="vram")
    with pytest.raises(ValueError, match="cache_dir"):
        FastTraining(cache="disk")
    with pytest.raises(ValueError, match="ram_budget_mib"):
        FastTraining(ram_budget_mib=-1)
    from ignite.engine import Engine

    with pytest.raises(TypeError, match="SupervisedTrainer"):
        FastTraining().attach(Engine(lambda e, b: None))


def _rank_items(local_rank, files, out):
    import ignite.distributed as idist
    from torch.utils.data import DistributedSampler

    rank, world = idist.get_rank(), idist.get_world_size()
    ds = Dataset(files[0], _chain(True))
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=1, sampler=sampler)
    trainer, evaluator = _user_trainer(files, train_loader=loader, max_epochs=3)
    fast = FastTraining()  # every lever auto: the decisions must agree across ranks
    fast.attach(trainer)
    seen: dict[int, list[str]] = {}
    trainer.add_event_handler(
        Events.ITERATION_STARTED,
        lambda e: seen.setdefault(e.state.epoch, []).extend(
            str(f) for f in e.state.batch["image"].meta["filename_or_obj"]
        ),
    )
    trainer.run()
    decisions = {lever: what["setting"] for lever, what in fast.applied.items() if lever != "data"}
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "seen": {str(k): v for k, v in seen.items()},
                "items": len(trainer.data_loader.dataset),
                "steps": trainer.state.epoch_length,
                "sampler_kept": trainer.data_loader.sampler is sampler,
                "data": fast.applied["data"],
                "decisions": decisions,
            }
        )
    )


@pytest.mark.parametrize("backend", ["gloo", "horovod"])
def test_two_ranks_keep_the_users_distributed_sampler_over_one_copy_per_node_and_agree(
    backend, tiny_files, tmp_path, monkeypatch
):
    """The user's DistributedSampler (shuffle across ranks, set_epoch) stays as written: across epochs each rank
    trains on items from the whole data set, every epoch every item once over the two ranks, and the node holds
    one cached copy (one item folder per item in the shared crop cache), as the issue asks of a DDP trainer."""
    import os
    from pathlib import Path

    import ignite.distributed as idist

    if backend == "horovod":
        pytest.importorskip(
            "horovod.torch", reason="Horovod is not built here: python scripts/build_horovod.py (the CI does)"
        )
        # horovodrun's processes unpickle _rank_items by its module: let them import this file
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
        )
    port = {} if backend == "horovod" else {"master_port": free_port()}  # ignite's fixed default clashes
    with idist.Parallel(backend=backend, nproc_per_node=2, **port) as parallel:
        parallel.run(_rank_items, tiny_files, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["decisions"] == ranks[1]["decisions"] and "memory_format" in ranks[0]["decisions"], ranks
    assert all(r["sampler_kept"] and r["data"]["setting"] == "disk" for r in ranks), [r["data"] for r in ranks]
    assert "DistributedSampler kept" in ranks[0]["data"]["reason"]
    n = len(tiny_files[0])
    assert all(r["items"] == n for r in ranks)  # every rank reads every item
    assert all(r["steps"] == math.ceil(n / 2) for r in ranks)  # as many steps as the sampler gives
    images = {str(f["image"]) for f in tiny_files[0]}
    for epoch in ("1", "2", "3"):
        both = [s for r in ranks for s in set(r["seen"][epoch])]
        assert set(both) == images and len(both) <= n + 1, epoch  # every item each epoch (the sampler pads 1)
    over_epochs = [set().union(*(set(r["seen"][e]) for e in ("1", "2", "3"))) for r in ranks]
    assert all(len(s) > math.ceil(n / 2) for s in over_epochs), over_epochs  # not a fixed half: the user's shuffle
    crops = tmp_path / "cache" / "crops"
    assert len([p for p in crops.iterdir() if p.is_dir()]) == n  # one copy per node: one folder per item


def test_doctor_apply_prescribes_fast_training_or_what_unblocks_its_levers(tiny_files, tmp_path, capsys):
    from monai_fast.apps.cli import main

    def my_collate(batch):
        return list_data_collate(batch)

    for name, fast in (("plain", None), ("refused", FastTraining(precision=False, memory_format=False))):
        loader = DataLoader(Dataset(tiny_files[0], _chain(True)), batch_size=2, collate_fn=my_collate)
        trainer, evaluator = _user_trainer(tiny_files, train_loader=loader)
        RecordHandler(tmp_path / name).attach(trainer)
        TimeBreakdown().attach(trainer)
        if fast is not None:
            fast.attach(trainer, evaluator)
        trainer.run()
        assert main(["doctor", str(tmp_path / name), "--apply"]) == 0
        out = capsys.readouterr().out.split("to apply (add before trainer.run()):")[1]
        if fast is None:
            assert out.strip().startswith("FastTraining().attach(trainer, evaluator)"), out
        else:
            assert "FastTraining is attached already" in out and "data: the collate function" in out
            assert "FastTraining(loader='thread')" in out, out


def test_validation_tune_measures_the_sliding_window_batch_once_and_reuses_the_store(tiny_files, tmp_path):
    from monai_fast.handlers.window_tune import sliding_window_of
    from monai_fast.tune import TuneStore

    store = tmp_path / "tuning.json"
    picks = []
    for _ in range(2):
        trainer, evaluator = _user_trainer(tiny_files)
        window = sliding_window_of(evaluator.inferer)
        fast = FastTraining(precision="fp32", memory_format=False, evaluator="tune", tune_store=store)
        fast.attach(trainer, evaluator)
        assert window.sw_batch_size == 2  # nothing measured before the evaluator's first run
        trainer.run()
        what = fast.applied["evaluator"]
        assert what["setting"] == f"sw_batch_size={window.sw_batch_size}" and "volumes/s" in what["reason"], what
        assert what["applied"] == (window.sw_batch_size != 2)
        picks.append((window.sw_batch_size, what["reason"]))
        assert math.isfinite(evaluator.state.metrics["val_mean_dice"])
    stored = TuneStore(store)._load()
    assert len(stored) == 1 and next(iter(stored)).endswith("|validation-only"), stored  # one measurement, kept
    assert picks[0][0] == picks[1][0] and "(cached)" in picks[1][1] and "(cached)" not in picks[0][1]


def test_validation_false_leaves_the_evaluator_as_built(tiny_files):
    trainer, evaluator = _user_trainer(tiny_files)
    loader, inferer = evaluator.data_loader, evaluator.inferer
    fast = FastTraining(evaluator=False)
    fast.attach(trainer, evaluator)
    assert evaluator.data_loader is loader and evaluator.inferer is inferer
    assert not fast.applied["evaluator"]["applied"] and "validation data" not in fast.applied
    assert trainer.data_loader is not None and fast.applied["data"]["applied"]  # the trainer's levers still apply


def test_validation_tune_with_an_inferer_that_is_not_a_sliding_window_says_so(tiny_files):
    from monai.inferers import SimpleInferer

    trainer, evaluator = _user_trainer(tiny_files)
    evaluator.inferer = SimpleInferer()
    fast = FastTraining(precision="fp32", evaluator="tune")
    fast.attach(trainer, evaluator)
    assert (
        not fast.applied["evaluator"]["applied"] and "not a SlidingWindowInferer" in fast.applied["evaluator"]["reason"]
    )
    from monai_fast.handlers import SlidingWindowTune

    with pytest.raises(
        TypeError, match="is not a SlidingWindowInferer"
    ):  # the handler on its own, through the wrappers
        SlidingWindowTune(lambda: "fp32", "cpu", store=None).attach(evaluator)


def test_background_fill_adopts_both_loaders_over_background_caches_validation_after_training(tiny_files):
    from monai.transforms import Lambdad

    from monai_fast.data.background import BackgroundCacheDataset

    def slowly(image):  # a deterministic step slow enough that the fill is still running after the attach
        time.sleep(0.3)
        return image

    chain = Compose([*_chain(False).transforms, Lambdad(keys="image", func=slowly), *_chain(True).transforms[6:]])
    loader = DataLoader(
        Dataset(tiny_files[0], chain), batch_size=2, shuffle=True, num_workers=0, collate_fn=list_data_collate
    )
    trainer, evaluator = _user_trainer(tiny_files, max_epochs=2, train_loader=loader)
    fast = FastTraining(precision="fp32", memory_format=False, background_fill=True)
    fast.attach(trainer, evaluator)
    train_ds, val_ds = trainer.data_loader.dataset, evaluator.data_loader.dataset
    assert isinstance(train_ds, BackgroundCacheDataset) and isinstance(val_ds, BackgroundCacheDataset)
    assert val_ds.fill.after is train_ds.fill  # validation fills after the training cache
    choices = [
        h for h in fast._helpers if isinstance(h, PrefetchChoice)
    ]  # they time nothing until both caches are full
    assert len(choices) == 2 and not train_ds.complete and not any(c.ready() for c in choices)
    seen = []
    trainer.add_event_handler(
        Events.ITERATION_STARTED,
        lambda e: seen.append(sorted(str(f) for f in e.state.batch["image"].meta["filename_or_obj"])),
    )
    trainer.run()
    per_epoch = len(seen) // 2
    first = [f for batch in seen[:per_epoch] for f in batch]
    assert sorted(set(first)) == sorted(str(f["image"]) for f in tiny_files[0])  # every item in the first epoch
    assert math.isfinite(evaluator.state.metrics["val_mean_dice"])
    assert train_ds.wait(30) and val_ds.wait(30) and all(c.ready() for c in choices)


def _monai_amp(engine) -> None:
    """Rebuild the engine's amp state as MONAI's ``amp=True`` leaves it (what a bundle's ``"amp": true`` builds)."""
    engine.amp = True
    engine.amp_kwargs = {}
    engine.scaler = torch.amp.GradScaler("cuda", enabled=False)


def test_monai_amp_on_a_cpu_is_read_as_a_request_for_reduced_precision(tiny_files):
    trainer, evaluator = _user_trainer(tiny_files)
    _monai_amp(trainer)
    _monai_amp(evaluator)
    dtypes = []
    hook = trainer.network.model[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    fast = FastTraining(precision="bf16", cache=False, loader=False, prefetch=False, prediction_layout=False)
    fast.attach(trainer, evaluator)
    row = fast.applied["precision"]
    assert row["applied"] and row["setting"] == "bf16"
    assert "MONAI's amp=True" in row["reason"] and "does nothing on cpu" in row["reason"]
    assert trainer.amp is False and evaluator.amp is False  # MONAI's CUDA-only autocast path switched off
    trainer.run()
    hook.remove()
    assert dtypes and set(dtypes) == {torch.bfloat16}  # training and validation forwards ran in bf16
    fast.detach(trainer)
    assert trainer.amp is True and evaluator.amp is True  # as built again


def test_monai_amp_auto_on_a_cpu_decides_by_the_device(tiny_files):
    trainer, evaluator = _user_trainer(tiny_files)
    _monai_amp(trainer)
    fast = FastTraining(cache=False, loader=False, prefetch=False, prediction_layout=False)
    fast.attach(trainer, evaluator)
    row = fast.applied["precision"]
    assert row["setting"] in ("bf16", "fp32") and "MONAI's amp=True" in row["reason"]
    assert fast.amp is not None and trainer.amp is False


def test_fast_training_guards_both_engines_against_short_epochs(tiny_files):
    from monai_fast.handlers import EpochLengthGuard

    trainer, evaluator = _user_trainer(tiny_files)
    fast = FastTraining(cache=False, loader=False, prefetch=False, prediction_layout=False, precision=False)
    fast.attach(trainer, evaluator)
    assert EpochLengthGuard in handlers_on(trainer) and EpochLengthGuard in handlers_on(evaluator)
    trainer.run()  # full epochs pass the guard
    fast.detach(trainer)
    assert EpochLengthGuard not in handlers_on(trainer) and EpochLengthGuard not in handlers_on(evaluator)


def test_data_beyond_the_ram_budget_go_to_a_crop_cache_on_disk_with_every_item_in_every_epoch(tiny_files, tmp_path):
    from monai_fast.data.crop_cache import CropCacheDataset
    from monai_fast.folders import cache_root

    plain, _ = _user_trainer(tiny_files, seed=3, max_epochs=2)
    want = _crops(plain)
    plain.run()
    trainer, evaluator = _user_trainer(tiny_files, seed=3, max_epochs=2)
    got = _crops(trainer)
    fast = FastTraining(ram_budget_mib=0.01, evaluator=False, prediction_layout=False, precision=False)
    fast.attach(trainer, evaluator)
    assert fast.applied["data"]["setting"] == "disk", fast.applied["data"]
    assert "CropCacheDataset" in fast.applied["data"]["reason"], fast.applied["data"]
    ds = trainer.data_loader.dataset
    assert isinstance(ds, CropCacheDataset) and ds.cache_dir == cache_root() / "crops"
    trainer.run()
    # no SmartCache window: every item in every epoch, the crops the user's own loader draws
    assert len(got) == len(want) == 2 * plain.state.epoch_length
    assert got == want
    assert len(list(ds.cache_dir.glob("*/item.json"))) == len(tiny_files[0])


def test_the_trainer_and_the_evaluator_share_one_ram_budget(tiny_files):
    """The RAM budget holds both caches: with room for the training items only, validation is not cached in RAM."""
    from monai_fast.data.items import item_bytes

    train_item = item_bytes(_chain(False)(dict(tiny_files[0][0])))
    need = train_item * len(tiny_files[0]) * 1.2  # the planner's margin
    trainer, evaluator = _user_trainer(tiny_files)
    fast = FastTraining(ram_budget_mib=need * 1.3 / 2**20, memory_format=False, compile=False, prefetch=False)
    fast.attach(trainer, evaluator)
    assert fast.applied["data"]["setting"] == "ram", fast.applied["data"]
    assert "of the RAM budget left" in fast.applied["data"]["reason"]
    assert fast.applied[Lever.VALIDATION_DATA]["setting"] != "ram", fast.applied[Lever.VALIDATION_DATA]
    trainer.run()  # and it trains


@pytest.mark.gpu
def test_the_trainer_and_the_evaluator_share_one_gpu_budget(tiny_files):
    """A GPU budget given holds both caches, as the RAM budget does."""
    from monai_fast.data.items import item_bytes

    train_item = item_bytes(_chain(False)(dict(tiny_files[0][0])))
    need = train_item * len(tiny_files[0]) * 1.2  # the planner's margin
    trainer, evaluator = _user_trainer(tiny_files)
    trainer.network.cuda()
    for engine in (trainer, evaluator):
        engine.state.device = torch.device("cuda")
    fast = FastTraining(gpu_budget_mib=need * 1.3 / 2**20, memory_format=False, compile=False, prefetch=False)
    fast.attach(trainer, evaluator)
    assert fast.applied["data"]["setting"] == "gpu", fast.applied["data"]
    assert "of the GPU budget left" in fast.applied["data"]["reason"]
    assert fast.applied[Lever.VALIDATION_DATA]["setting"] != "gpu", fast.applied[Lever.VALIDATION_DATA]
    trainer.run()


def test_the_default_ram_budget_is_shared_by_the_nodes_ranks():
    import ignite.distributed as idist

    from monai_fast.data.planner import default_ram_budget

    assert default_ram_budget(available=8 * 2**30) == 4 * 2**30
    with idist.Parallel(backend="gloo", nproc_per_node=2, master_port=free_port()) as parallel:
        parallel.run(_budget_of_a_rank)


def _budget_of_a_rank(local_rank):
    from monai_fast.data.planner import default_ram_budget

    assert default_ram_budget(available=8 * 2**30) == 2 * 2**30  # two ranks on the node: a quarter each
