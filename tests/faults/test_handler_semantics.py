"""Handlers in real user set-ups: re-run notebook cells, one handler on two engines, MONAI's handler
order, a second ``trainer.run()`` and multi-rank records. Real MONAI engines on tiny tensors."""

from __future__ import annotations

import time

import pytest
import torch
from ignite.engine import Engine, Events
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import ValidationHandler

from monai_fast.handlers import (
    GPUSampler,
    KernelProfiler,
    NVTXHandler,
    RecordHandler,
    ThroughputMonitor,
    TimeBreakdown,
    TimeToTarget,
)
from monai_fast.handlers.lifecycle import handlers_on
from monai_fast.telemetry.nvml import FakeNvml
from monai_fast.telemetry.record import Kind, Source, load_record, select

VAL_SLEEP_S = 0.25


def _batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "image": torch.rand(2, 1, 8, 8, 8, generator=g),
            "label": (torch.rand(2, 1, 8, 8, 8, generator=g) > 0.5).float(),
        }
        for _ in range(n)
    ]


def _monai_engines(train_handlers_first: list | None = None) -> tuple[SupervisedTrainer, SupervisedEvaluator]:
    net = torch.nn.Conv3d(1, 1, 3, padding=1)

    class SlowNet(torch.nn.Module):  # validation takes a known, long time
        def forward(self, x):
            time.sleep(VAL_SLEEP_S / 2)
            return net(x)

    evaluator = SupervisedEvaluator(device="cpu", val_data_loader=_batches(2), network=SlowNet())
    val = ValidationHandler(validator=evaluator, interval=1, epoch_level=True)
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=2,
        train_data_loader=_batches(4),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        loss_function=torch.nn.BCEWithLogitsLoss(),
        train_handlers=[*(train_handlers_first or []), val],
    )
    return trainer, evaluator


def test_a_rerun_cell_replaces_each_handler_and_counts_once(tmp_path):
    trainer, evaluator = _monai_engines()
    cells = []
    for _ in range(2):  # the same notebook cell, run twice
        cell = {
            "record": RecordHandler(tmp_path),
            "breakdown": TimeBreakdown(),
            "throughput": ThroughputMonitor(),
            "nvtx": NVTXHandler(),
            "profiler": KernelProfiler(tmp_path / "prof", wait=0, warmup=0, active=1),
            "gpu": GPUSampler(interval_s=0.01, backend=FakeNvml()),
            "stopper": TimeToTarget(target=2.0, metric_name="x"),
        }
        cell["record"].attach(trainer)
        for name in ("breakdown", "throughput", "nvtx", "profiler", "gpu"):
            cell[name].attach(trainer)
        cell["stopper"].attach(trainer, evaluator)
        cells.append(cell)
    old, new = cells
    evaluator.add_event_handler(Events.STARTED, lambda e: e.state.metrics.update(x=0.0))  # what TimeToTarget reads
    trainer.run()
    assert trainer.state.epoch == 2
    assert (
        len(trainer.state.time_breakdown) == 2 and len(new["breakdown"].epochs) == 2 and old["breakdown"].epochs == []
    )
    assert len(new["throughput"].epochs) == 2 and old["throughput"].epochs == []
    assert new["gpu"].n_samples > 0 and old["gpu"].n_samples == 0
    assert old["profiler"].summary is None and new["profiler"].summary is not None
    assert old["stopper"].history == [] and len(new["stopper"].history) == 2  # its evaluator callbacks went too
    assert all(not c.is_attached() for c in old.values())
    assert {type(h) for h in handlers_on(trainer).values()} == {type(h) for h in new.values()}
    rows, _ = load_record(tmp_path)
    assert len(select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN)) == 2
    assert len(select(rows, Kind.EPOCH, Source.THROUGHPUT)) == 2


def test_the_same_instance_twice_or_on_two_engines_is_refused():
    trainer, evaluator = _monai_engines()
    tb = TimeBreakdown()
    tb.attach(trainer)
    with pytest.raises(RuntimeError, match="already attached to this engine"):
        tb.attach(trainer)
    with pytest.raises(RuntimeError, match="one TimeBreakdown per engine"):
        tb.attach(evaluator)  # the evaluator would overwrite the trainer's epoch
    TimeBreakdown().attach(evaluator)  # its own instance is fine
    trainer.run()
    assert [e.epoch for e in tb.epochs] == [1, 2] and all(e.iterations == 4 for e in tb.epochs)


@pytest.mark.parametrize("throughput_first", [True, False], ids=["throughput-first", "validation-first"])
def test_throughput_excludes_validation_in_every_handler_order(throughput_first):
    tp = ThroughputMonitor(log_every_epoch=False)
    rec = RecordHandler(None)  # in memory
    trainer, _ = _monai_engines([rec, tp] if throughput_first else [rec])
    if not throughput_first:
        tp.attach(trainer)  # after MONAI's ValidationHandler, as in MONAI's train_handlers order
    trainer.run()
    steps = select(rec.record.rows, Kind.ITERATION, Source.THROUGHPUT)
    for ep in tp.epochs:
        step_s = sum(r["iteration_s"] for r in steps if r["epoch"] == ep["epoch"])
        assert ep["epoch_s"] == pytest.approx(step_s, rel=1e-9), f"validation counted as training: {ep}"
        assert ep["samples"] == 8
    assert len(tp.epoch_ends) == 1 and tp.epoch_ends[0] >= VAL_SLEEP_S, "validation time belongs to the epoch end"
    assert tp.epochs[1]["epoch_end_s"] == tp.epoch_ends[0]


def test_a_second_run_is_recorded_as_a_new_segment(tmp_path):
    engine = Engine(lambda e, b: None)
    RecordHandler(tmp_path).attach(engine)
    TimeBreakdown().attach(engine)
    engine.run(list(range(3)), max_epochs=2)
    engine.run(list(range(3)), max_epochs=3)  # continues: one more epoch
    rows, summary = load_record(tmp_path)
    epochs = select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN)
    assert [(r["segment"], r["epoch"]) for r in epochs] == [(0, 1), (0, 2), (1, 3)]
    assert summary["segments"] == 2


def test_record_rows_name_their_engine(tmp_path):
    trainer, evaluator = _monai_engines()
    rec = RecordHandler(tmp_path)
    rec.attach(trainer)
    rec.attach(evaluator)
    TimeBreakdown().attach(trainer)
    TimeBreakdown().attach(evaluator)
    trainer.run()
    rows, _ = load_record(tmp_path)
    assert len(select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN, engine="train")) == 2
    assert len(select(rows, Kind.EPOCH, Source.TIME_BREAKDOWN, engine="validation")) == 2
    with pytest.raises(ValueError, match="taken"):
        RecordHandler(tmp_path / "other").attach(Engine(lambda e, b: None), name="x") or rec.attach(
            Engine(lambda e, b: None), name="validation"
        )


def test_detach_removes_every_callback():
    engine = Engine(lambda e, b: None)
    tb = TimeBreakdown()
    before = {ev: len(engine._event_handlers.get(ev, [])) for ev in Events}
    tb.attach(engine)
    tb.detach(engine)
    after = {ev: len(engine._event_handlers.get(ev, [])) for ev in Events}
    assert before == after
    engine.run([0, 1], max_epochs=1)
    assert tb.epochs == []
