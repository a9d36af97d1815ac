"""Where FastTraining meets what users built themselves: their own step functions and loader options.

Real MONAI ``SupervisedTrainer`` / ``SupervisedEvaluator`` engines on tiny in-memory volumes; the
precision a forward ran in is read by a forward hook inside the network (the output's dtype and
``torch.is_autocast_enabled``), the epochs' items by handlers on the engine.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
from ignite.engine import Events
from monai.data import DataLoader, Dataset, SmartCacheDataset, ThreadDataLoader, list_data_collate
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.inferers import SimpleInferer
from torch.utils.data import RandomSampler

from monai_fast.handlers import FastTraining, RecordHandler
from monai_fast.handlers.lifecycle import callbacks_on, handlers_on
from monai_fast.telemetry.record import Kind, Source, load_record, select


def _items(n: int = 6) -> list[dict]:
    return [{"image": torch.full((1, 4, 4, 4), float(i)), "label": torch.zeros(1, 4, 4, 4), "id": i} for i in range(n)]


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3, padding=1), torch.nn.Conv3d(2, 1, 1))


class _Seen:
    """A forward hook listing (output dtype, autocast on) of each forward (a class: a network with it pickles)."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.dtype, bool]] = []

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.seen.append((output.dtype, torch.is_autocast_enabled("cpu")))


def _forwards_seen(net: torch.nn.Module) -> list[tuple[torch.dtype, bool]]:
    """(output dtype, autocast on) of each forward of the network's first layer, as it runs."""
    hook = _Seen()
    net[0].register_forward_hook(hook)
    return hook.seen


def _own_step(module: torch.nn.Module | None = None):
    """A user's training step that calls the network itself (``module``: another one, by mistake or design)."""

    def step(engine, batch):
        engine.network.train()
        engine.optimizer.zero_grad()
        out = (module or engine.network)(batch["image"])
        loss = (out.float() - batch["label"]).abs().mean()
        loss.backward()
        engine.optimizer.step()
        return {"loss": loss.item(), "dtype": out.dtype}

    return step


def _trainer(net, step=None, loader=None, max_epochs=1, handlers=None):
    return SupervisedTrainer(
        device="cpu",
        max_epochs=max_epochs,
        train_data_loader=loader or DataLoader(Dataset(_items(4)), batch_size=2),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=torch.nn.L1Loss(),
        iteration_update=step,
        train_handlers=handlers,
    )


# ---- precision reaches the user's own step --------------------------------------------------------


def test_a_users_own_step_runs_in_the_precision_that_fast_training_records(tmp_path):
    net = _net()
    seen = _forwards_seen(net)
    trainer = _trainer(net, _own_step())
    RecordHandler(tmp_path).attach(trainer)
    fast = FastTraining(precision="bf16", memory_format=False, prefetch=False)
    fast.attach(trainer)
    trainer.run()
    assert seen == [(torch.bfloat16, True)] * 2  # both steps' forwards, as recorded
    assert trainer.state.output["dtype"] == torch.float32  # the step's loss gets fp32, as through the inferer
    assert fast.applied["precision"] == {"applied": True, "setting": "bf16", "reason": "requested bf16"}
    rows, _ = load_record(tmp_path)
    assert [r["active"] for r in select(rows, Kind.EPOCH, Source.AMP)] == [True]
    # outside the engine's step the network is the user's own again: a notebook's call, a copy, a pickle
    x = torch.zeros(1, 1, 4, 4, 4)
    torch.save(net, io.BytesIO())
    for copied in (net, copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        outside = _forwards_seen(copied)
        copied(x)
        assert outside == [(torch.float32, False)]


def test_the_default_step_and_an_evaluators_own_step_both_run_in_the_recorded_precision():
    net = _net()
    seen = _forwards_seen(net)

    def own_eval_step(engine, batch):
        with torch.no_grad():
            return {"pred": engine.network(batch["image"]), "label": batch["label"]}

    evaluator = SupervisedEvaluator(
        device="cpu",
        val_data_loader=DataLoader(Dataset(_items(2)), batch_size=1),
        network=net,
        inferer=SimpleInferer(),
        iteration_update=own_eval_step,
    )
    trainer = _trainer(net)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run())
    fast = FastTraining(precision="bf16", memory_format=False, prefetch=False, prediction_layout=True)
    fast.attach(trainer, evaluator)
    trainer.run()
    assert seen == [(torch.bfloat16, True)] * 4  # two training steps (MONAI's), two validation steps (the user's)
    assert fast.applied["precision"]["applied"] and "validation precision" not in fast.applied
    # the evaluator's own step never calls its inferer: the layout lever did not act, and says so
    layout = fast.applied["prediction_layout"]
    assert not layout["applied"] and "does not call its inferer" in layout["reason"]


def test_a_step_out_of_the_levers_reach_is_recorded_as_not_applied_with_one_warning(tmp_path, caplog):
    net, other = _net(), _net()
    seen = _forwards_seen(other)
    trainer = _trainer(net, _own_step(other))  # the step trains a module the engine does not know
    RecordHandler(tmp_path).attach(trainer)
    fast = FastTraining(precision="bf16", memory_format=False, prefetch=False)
    fast.attach(trainer)
    with caplog.at_level(logging.WARNING, logger="monai_fast"):
        trainer.run()
    assert seen == [(torch.float32, False)] * 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1
        and "bf16 did not act" in warnings[0]
        and "neither its inferer nor its network" in warnings[0]
    )
    row = fast.applied["precision"]
    assert not row["applied"] and row["reason"].startswith("did not act:")
    rows, summary = load_record(tmp_path)
    recorded = [r for r in select(rows, Kind.EVENT, Source.FAST_TRAINING) if r["lever"] == "precision"]
    assert recorded[-1]["applied"] is False and summary["fast_training"]["precision"]["applied"] is False
    assert [r["active"] for r in select(rows, Kind.EPOCH, Source.AMP)] == [False]


# ---- the user's loader options ----------------------------------------------------------------------


def _epochs(make_loader, fast: bool, epochs: int = 3, **options) -> list[list[list[int]]]:
    """The ids of each epoch's batches, with or without FastTraining."""
    trainer = _trainer(torch.nn.Conv3d(1, 1, 1), loader=make_loader(Dataset(_items())), max_epochs=epochs)
    seen: list[list[list[int]]] = []
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: seen.append([]))
    trainer.add_event_handler(
        Events.ITERATION_STARTED, lambda e: seen[-1].append([int(i) for i in e.state.batch["id"]])
    )
    if fast:
        f = FastTraining(precision=False, memory_format=False, prefetch=False, **options)
        f.attach(trainer)
        assert f.applied["data"]["applied"], f.applied["data"]
    torch.manual_seed(0)
    trainer.run()
    return seen


@pytest.mark.parametrize(
    "make_loader, options",
    [
        (lambda ds: ThreadDataLoader(ds, batch_size=2, repeats=2), {}),
        (lambda ds: ThreadDataLoader(ds, batch_size=2, repeats=3, buffer_size=2, shuffle=True), {}),
        (lambda ds: DataLoader(ds, batch_size=4, drop_last=True, collate_fn=list_data_collate), {}),
        (
            lambda ds: DataLoader(ds, batch_size=2, num_workers=1, persistent_workers=True, prefetch_factor=3),
            {"cache": "none"},
        ),
    ],
    ids=["repeats", "repeats-shuffled-buffered", "drop_last-collate", "workers-kept"],
)
def test_the_epochs_items_are_the_users_loaders_with_and_without_fast_training(make_loader, options):
    assert _epochs(make_loader, fast=True, **options) == _epochs(make_loader, fast=False)


def test_the_adopted_loader_keeps_the_repeats_and_worker_options():
    trainer = _trainer(
        torch.nn.Conv3d(1, 1, 1),
        loader=DataLoader(Dataset(_items()), batch_size=2, num_workers=1, persistent_workers=True, prefetch_factor=3),
    )
    FastTraining(cache="none", precision=False, memory_format=False, prefetch=False).attach(trainer)
    loader = trainer.data_loader
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (1, True, 3)
    trainer = _trainer(torch.nn.Conv3d(1, 1, 1), loader=ThreadDataLoader(Dataset(_items()), batch_size=2, repeats=2))
    fast = FastTraining(precision=False, memory_format=False, prefetch=False)
    fast.attach(trainer)
    assert trainer.data_loader.repeats == 2 and "repeats=2" in fast.applied["data"]["reason"]


def test_a_sampler_drawing_with_replacement_is_left_alone_and_says_why():
    ds = Dataset(_items())
    loader = DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, replacement=True, num_samples=4))
    trainer = _trainer(torch.nn.Conv3d(1, 1, 1), loader=loader)
    fast = FastTraining(precision=False, memory_format=False, prefetch=False)
    fast.attach(trainer)
    assert trainer.data_loader is loader
    assert not fast.applied["data"]["applied"] and "with replacement" in fast.applied["data"]["reason"]


def _changing_items(fast: bool, how: str) -> list[list[int]]:
    """The ids each epoch trains on when a handler changes the data set's items after each epoch."""
    ds = Dataset(_items(4))
    trainer = _trainer(torch.nn.Conv3d(1, 1, 1), loader=DataLoader(ds, batch_size=2), max_epochs=3)
    seen: list[list[int]] = []
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: seen.append([]))
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: seen[-1].extend(int(i) for i in e.state.batch["id"]))

    def curriculum(engine):  # the next epoch's items: replaced as a list, or one item replaced in place
        step = 10 * engine.state.epoch
        if how == "list":
            ds.data = [{**item, "id": item["id"] + step} for item in _items(4)]
        elif how == "more":  # a curriculum that grows: more batches per pass from then on
            ds.data = [{**item, "id": item["id"] + step} for item in _items(4 + 2 * engine.state.epoch)]
        else:
            ds.data[0] = {**ds.data[0], "id": step}

    trainer.add_event_handler(Events.EPOCH_COMPLETED, curriculum)
    if fast:
        fast_training = FastTraining(precision=False, memory_format=False, prefetch=False)
        fast_training.attach(trainer)
        assert fast_training.applied["data"]["setting"] == "ram"
    trainer.run()
    if fast:  # the record says the cache stopped serving, and why
        row = fast_training.applied["data"]
        assert not row["applied"] and "changed its data set's items" in row["reason"]
    return seen


@pytest.mark.parametrize("how", ["list", "item", "more"])
def test_items_the_script_changes_between_epochs_are_the_ones_trained_on(how, caplog):
    with caplog.at_level(logging.WARNING, logger="monai_fast"):
        assert _changing_items(True, how) == _changing_items(False, how)
    said = [m.getMessage() for m in caplog.records if "changed its data set's items" in m.getMessage()]
    assert len(said) == 1 and "before epoch 2" in said[0]


def test_a_data_set_whose_items_stay_keeps_its_cache_and_detaching_mid_run_gives_the_loader_back_at_its_end():
    ds = Dataset(_items(4))
    loader = DataLoader(ds, batch_size=2)
    trainer = _trainer(torch.nn.Conv3d(1, 1, 1), loader=loader, max_epochs=3)
    fast = FastTraining(precision=False, memory_format=False, prefetch=False)
    fast.attach(trainer)
    adopted = trainer.data_loader
    held = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=2), lambda e: fast.detach(e))
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=3), lambda e: held.append(e.data_loader))
    trainer.run()
    assert fast.applied["data"]["applied"] and held == [adopted]  # nothing changed: the cache served every epoch
    assert trainer.data_loader is loader  # detached while running: given back when the run ended


def test_a_smartcache_that_the_script_does_not_rotate_is_left_as_it_is():
    ds = SmartCacheDataset(_items(6), transform=None, cache_num=3, replace_rate=0.34, progress=False)
    loader = DataLoader(ds, batch_size=3)
    trainer = _trainer(torch.nn.Conv3d(1, 1, 1), loader=loader, max_epochs=3)
    seen: list[list[int]] = []
    trainer.add_event_handler(
        Events.ITERATION_STARTED, lambda e: seen.append(sorted(int(i) for i in e.state.batch["id"]))
    )
    fast = FastTraining(precision=False, memory_format=False, prefetch=False)
    fast.attach(trainer)
    assert trainer.data_loader is loader and "window never rotates" in fast.applied["data"]["reason"]
    trainer.run()
    assert len(seen[0]) == 3 and seen == [seen[0]] * 3  # MONAI's window, never rotated by the script, stays


def test_an_evaluator_alone_is_refused_before_anything_changes():
    evaluator = SupervisedEvaluator(
        device="cpu",
        val_data_loader=DataLoader(Dataset(_items(2)), batch_size=1),
        network=_net(),
        inferer=SimpleInferer(),
    )
    loader = evaluator.data_loader
    with pytest.raises(TypeError, match="an evaluator goes second, beside its trainer"):
        FastTraining().attach(evaluator)
    assert evaluator.data_loader is loader and not handlers_on(evaluator)
    assert not any(callbacks_on(evaluator, event) for event in (Events.STARTED, Events.ITERATION_STARTED))


def test_detaching_gives_the_engines_their_own_loaders_back():
    trainer = _trainer(torch.nn.Conv3d(1, 1, 1))
    evaluator = SupervisedEvaluator(
        device="cpu",
        val_data_loader=DataLoader(Dataset(_items(2)), batch_size=1),
        network=_net(),
        inferer=SimpleInferer(),
    )
    loaders = (trainer.data_loader, evaluator.data_loader)
    fast = FastTraining(precision=False, memory_format=False, prefetch=False)
    fast.attach(trainer, evaluator)
    assert (trainer.data_loader, evaluator.data_loader) != loaders
    fast.detach(trainer)
    assert (trainer.data_loader, evaluator.data_loader) == loaders


# ---- attached during a run; the prefetch decision of a short run --------------------------------------


@pytest.mark.parametrize("event", [Events.STARTED, Events.ITERATION_COMPLETED(once=2)])
def test_attaching_from_a_handler_during_the_run_is_refused_in_one_line_and_changes_nothing(event):
    trainer = _trainer(_net())
    loader = trainer.data_loader
    refused = []

    def attach_late(engine):
        try:
            FastTraining(memory_format=False).attach(engine)
        except RuntimeError as e:
            refused.append(str(e))

    trainer.add_event_handler(event, attach_late)
    trainer.run()
    assert len(refused) == 1 and refused[0].startswith("FastTraining: attach FastTraining before run()")
    assert "\n" not in refused[0] and trainer.data_loader is loader and trainer.state.iteration == 2
    fast = FastTraining(memory_format=False, prefetch=False)  # between runs it attaches as before
    fast.attach(trainer)
    assert fast.applied["data"]["applied"]


def test_a_run_too_short_to_measure_prefetch_logs_and_records_the_setting_it_kept(tmp_path, caplog):
    trainer = _trainer(_net(), loader=DataLoader(Dataset(_items(8)), batch_size=2))  # 4 iterations: a block, not a pair
    RecordHandler(tmp_path).attach(trainer)
    fast = FastTraining(precision=False, memory_format=False)
    fast.attach(trainer)
    assert fast.applied["prefetch"]["setting"] == "measuring"
    with caplog.at_level(logging.INFO, logger="monai_fast"):
        trainer.run()
    row = fast.applied["prefetch"]
    assert row["setting"] == "on demand" and row["reason"].startswith("on demand kept: the run ended after")
    assert any(m.getMessage().startswith("FastTraining prefetch: on demand: on demand kept") for m in caplog.records)
    _, summary = load_record(tmp_path)
    assert summary["fast_training"]["prefetch"]["setting"] == "on demand"
