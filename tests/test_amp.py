import logging

import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver
from monai.data import DataLoader
from monai.engines import SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.losses import DiceCELoss

from monai_fast.apps.recipes import build_recipe
from monai_fast.handlers import AMPToggle, NonFiniteGuard, RecordHandler
from monai_fast.handlers.lifecycle import handlers_on
from monai_fast.telemetry import precision
from monai_fast.telemetry.record import load_record


def _train_conv_dtypes(recipe):
    """Per training epoch, the dtypes conv layers produced during training iterations (not validation)."""
    per_epoch, state = [], {"on": False}
    for m in recipe.network.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.register_forward_hook(lambda mod, i, o: per_epoch[-1].add(o.dtype) if state["on"] else None)
    t = recipe.trainer
    t.add_event_handler(Events.EPOCH_STARTED, lambda e: per_epoch.append(set()))
    t.add_event_handler(Events.ITERATION_STARTED, lambda e: state.update(on=True))
    t.add_event_handler(IterationEvents.FORWARD_COMPLETED, lambda e: state.update(on=False))
    return per_epoch


def _cfg(tiny_config, **kw):
    return type(tiny_config)(**{**tiny_config.to_dict(), **kw})


def test_bf16_on_cpu_and_a_per_epoch_schedule(tiny_files, tiny_config, tmp_path):
    r = build_recipe("monai_tutorial", *tiny_files, _cfg(tiny_config, max_epochs=3), progress=False)
    RecordHandler(tmp_path).attach(r.trainer)
    AMPToggle("bf16", schedule=lambda epoch: epoch != 2).attach(r.trainer)
    dtypes = _train_conv_dtypes(r)
    r.trainer.run()
    assert dtypes == [{torch.bfloat16}, {torch.float32}, {torch.bfloat16}]
    rows, summary = load_record(tmp_path)
    assert [row["active"] for row in rows if row["source"] == "amp"] == [True, False, True]
    assert summary["amp"]["precision"] == "bf16" and summary["amp"]["nonfinite"] == 0
    assert r.trainer.state.output[0]["pred"].dtype == torch.float32  # the loss saw fp32


class _NaNLoss(torch.nn.Module):
    """The real loss, but NaN on chosen iterations."""

    def __init__(self, inner, bad):
        super().__init__()
        self.inner, self.bad, self.i = inner, set(bad), 0

    def forward(self, pred, label):
        self.i += 1
        loss = self.inner(pred, label)
        return loss * float("nan") if self.i in self.bad else loss


def test_nonfinite_losses_skip_steps_then_fall_back_to_fp32(tiny_files, tiny_config, caplog):
    r = build_recipe("monai_tutorial", *tiny_files, _cfg(tiny_config, max_epochs=3), progress=False)
    r.trainer.loss_function = _NaNLoss(r.loss_function, bad={2, 3, 4})
    amp = AMPToggle("bf16", max_nonfinite=3)
    amp.attach(r.trainer)
    snapshots = {}
    r.trainer.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: snapshots.__setitem__(e.state.iteration, [p.detach().clone() for p in r.network.parameters()]),
    )
    dtypes = _train_conv_dtypes(r)
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        r.trainer.run()
    assert amp.stats["nonfinite"] == 3 and amp.stats["skipped_steps"] == 3
    for it in (2, 3, 4):  # a NaN loss left the weights as they were
        assert all(torch.equal(a, b) for a, b in zip(snapshots[it - 1], snapshots[it], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[4], snapshots[5], strict=True))
    assert amp.fell_back and not amp.active
    assert caplog.text.count("falling back to fp32") == 1
    assert dtypes[-1] == {torch.float32}
    assert all(torch.isfinite(p).all() for p in r.network.parameters())


def test_auto_on_a_cpu_without_bf16_hardware_trains_in_fp32_without_timing(tiny_files, tiny_config, monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_bf16_hardware", lambda flags=None: False)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", _never_timed)
    r = build_recipe("monai_tutorial", *tiny_files, tiny_config, progress=False)
    amp = AMPToggle("auto")
    amp.attach(r.trainer)
    dtypes = _train_conv_dtypes(r)
    r.trainer.run()
    assert amp.precision == "fp32" and not amp.active and dtypes == [{torch.float32}]


def _never_timed(rounds=3):
    raise AssertionError("AMPToggle measured where it should not")


def _tiny_trainer(max_epochs):
    """A real MONAI trainer: one 3D conv on four random 8^3 volumes, two per batch."""
    torch.manual_seed(0)
    net = torch.nn.Conv3d(1, 2, 3, padding=1)
    data = [{"image": torch.rand(1, 8, 8, 8), "label": torch.randint(0, 2, (1, 8, 8, 8))} for _ in range(4)]
    return SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=max_epochs,
        train_data_loader=DataLoader(data, batch_size=2),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_function=DiceCELoss(to_onehot_y=True, softmax=True),
    )


@pytest.mark.parametrize("load_before_attach", [True, False])
def test_a_checkpoint_restores_the_precision_and_counts(tmp_path, monkeypatch, load_before_attach):
    first = _tiny_trainer(max_epochs=2)
    first.loss_function = _NaNLoss(first.loss_function, bad={3})
    amp = AMPToggle("bf16")
    amp.attach(first)
    ckpt = Checkpoint({"trainer": first, "amp": amp}, DiskSaver(tmp_path, require_empty=False), n_saved=1)
    first.add_event_handler(Events.EPOCH_COMPLETED, ckpt)
    first.run()
    assert amp.stats["nonfinite"] == 1
    saved = torch.load(tmp_path / ckpt.last_checkpoint, weights_only=False)

    # the resumed process would decide fp32 on its own (no bf16 hardware) and must not measure
    monkeypatch.setattr(precision, "cpu_has_bf16_hardware", lambda flags=None: False)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", _never_timed)
    resumed = _tiny_trainer(max_epochs=3)
    again = AMPToggle("auto")
    to_load = {"trainer": resumed, "amp": again}
    if load_before_attach:
        Checkpoint.load_objects(to_load, saved)
        again.attach(resumed)
    else:
        again.attach(resumed)
        assert again.precision == "fp32"
        Checkpoint.load_objects(to_load, saved)
    assert again.precision == "bf16" and again.active and again.stats == amp.stats
    seen = set()
    resumed.network.register_forward_hook(lambda mod, i, o: seen.add(o.dtype))
    resumed.state.max_epochs = 3  # the checkpoint's trainer state says 2: one more epoch
    resumed.run()
    assert resumed.state.epoch == 3 and seen == {torch.bfloat16}
    assert again.state_dict()["stats"]["nonfinite"] == 1


def test_validation_and_wrong_engines(tiny_files, tiny_config):
    with pytest.raises(ValueError, match="precision must be one of"):
        AMPToggle("fp8")
    with pytest.raises(ValueError, match="max_nonfinite"):
        AMPToggle(max_nonfinite=0)
    with pytest.raises(TypeError, match="MONAI"):
        AMPToggle().attach(Engine(lambda e, b: None))
    r = build_recipe("monai_tutorial", *tiny_files, tiny_config, progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp16.*CUDA"):
            AMPToggle("fp16").attach(r.trainer)


def test_evaluator_autocast(tiny_files, tiny_config):
    r = build_recipe("monai_tutorial", *tiny_files, tiny_config, progress=False)
    AMPToggle("bf16").attach(r.evaluator)
    seen = set()
    for m in r.network.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.register_forward_hook(lambda mod, i, o: seen.add(o.dtype))
    r.evaluator.run()
    assert seen == {torch.bfloat16} and 0.0 <= r.evaluator.state.metrics["val_mean_dice"] <= 1.0


@pytest.mark.gpu
def test_fp16_on_cuda_counts_overflows(tiny_files, tiny_config):
    r = build_recipe("monai_tutorial", *tiny_files, _cfg(tiny_config, max_epochs=1), device="cuda", progress=False)
    r.trainer.loss_function = _NaNLoss(r.loss_function, bad={1})
    amp = AMPToggle("fp16")
    amp.attach(r.trainer)
    r.trainer.run()
    assert amp.precision == "fp16" and r.trainer.scaler is not None
    assert amp.stats["nonfinite"] == 1 and amp.stats["overflows"] == 1


def test_a_new_toggle_replaces_the_old_one_on_the_same_trainer():
    t = _tiny_trainer(max_epochs=1)
    plain = t.inferer
    t.loss_function = _NaNLoss(t.loss_function, bad={1})
    old = AMPToggle("bf16")
    old.attach(t)
    new = AMPToggle("bf16")
    new.attach(t)  # a re-run notebook cell
    assert t.inferer.inner is plain and t.inferer.toggle is new  # autocast applied once
    old.disable()  # the replaced toggle no longer drives the trainer
    seen = []
    t.network.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
    t.run()
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert new.stats["nonfinite"] == 1 and old.stats["nonfinite"] == 0  # counted once, by the new one
    assert list(handlers_on(t)).count(NonFiniteGuard) == 1
    new.detach(t)
    assert t.inferer is plain and not handlers_on(t)
