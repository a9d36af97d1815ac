import logging
import time

import pytest
from ignite.engine import Engine, Events

from monai_fast.handlers import TimeBreakdown, TimeToTarget


def _slow_data(n, delay):
    for i in range(n):
        time.sleep(delay)
        yield i


def _engine(step_s):
    return Engine(lambda e, b: time.sleep(step_s))


def test_time_breakdown_splits_data_wait_and_compute(caplog):
    engine = _engine(0.01)
    tb = TimeBreakdown(warn_threshold=0.5)
    tb.attach(engine)
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        # 80 ms fetches against 10 ms steps: the compute side needs a stall of 0.35 s to reach the data side
        engine.run(_slow_data(5, 0.08), max_epochs=1, epoch_length=5)
    (ep,) = engine.state.time_breakdown
    assert ep is tb.epochs[0] and ep.iterations == 5
    assert 0.4 <= ep.data_s < 1.0  # 5 fetches of >= 80 ms
    assert 0.05 <= ep.compute_s < ep.data_s  # 5 steps of >= 10 ms
    assert ep.data_share > 0.5
    assert "waiting for data" in caplog.text


def test_time_breakdown_no_warning_when_compute_bound(caplog):
    engine = _engine(0.1)  # 0.4 s of steps an epoch: only a 0.1 s stall in fetching reaches a 0.2 data share
    TimeBreakdown(warn_threshold=0.5).attach(engine)
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        engine.run(list(range(4)), max_epochs=2)
    assert len(engine.state.time_breakdown) == 2
    assert all(e.data_share < 0.2 for e in engine.state.time_breakdown)
    assert "waiting for data" not in caplog.text


def test_time_breakdown_validates_and_guards_double_attach():
    with pytest.raises(ValueError, match="warn_threshold"):
        TimeBreakdown(warn_threshold=0)
    with pytest.raises(ValueError, match="cuda_sync"):
        TimeBreakdown(cuda_sync="sometimes")
    engine = _engine(0)
    tb = TimeBreakdown()
    tb.attach(engine)
    with pytest.raises(RuntimeError, match="already attached"):
        tb.attach(engine)


def test_time_breakdown_cuda_sync_warns_once_without_cuda(caplog):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only fallback")
    with caplog.at_level(logging.WARNING, logger="monai_fast.handlers"):
        TimeBreakdown(cuda_sync=True).attach(_engine(0))
    assert caplog.text.count("CUDA is not available") == 1


def _trainer_with_rising_metric(per_epoch):
    trainer = _engine(0)
    evaluator = Engine(lambda e, b: None)

    @evaluator.on(Events.COMPLETED)
    def _score(e):
        e.state.metrics["dice"] = per_epoch * trainer.state.epoch

    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run([0]))
    return trainer, evaluator


def test_time_to_target_stops_at_first_epoch_meeting_target():
    trainer, evaluator = _trainer_with_rising_metric(0.25)
    stopper = TimeToTarget(target=0.7, metric_name="dice")
    stopper.attach(trainer, evaluator)
    trainer.run([0, 1], max_epochs=10)
    assert trainer.state.epoch == 3
    assert stopper.reached_epoch == 3 and stopper.reached_s is not None and stopper.reached_s >= 0
    assert [v for _, _, v in stopper.history] == pytest.approx([0.25, 0.5, 0.75])
    assert stopper.best == pytest.approx(0.75)
    assert not stopper.budget_exhausted


def test_time_to_target_budget_stops_mid_epoch():
    trainer = _engine(0.05)
    evaluator = Engine(lambda e, b: None)
    stopper = TimeToTarget(target=0.9, metric_name="dice", time_budget_s=0.2)
    stopper.attach(trainer, evaluator)
    trainer.run(list(range(100)), max_epochs=1)
    assert stopper.budget_exhausted and stopper.reached_s is None
    assert trainer.state.iteration < 20


def test_time_to_target_names_a_missing_metric():
    trainer, evaluator = _trainer_with_rising_metric(0.5)
    TimeToTarget(target=0.9, metric_name="val_mean_dice").attach(trainer, evaluator)
    with pytest.raises(KeyError, match="val_mean_dice"):
        trainer.run([0], max_epochs=2)


def test_time_to_target_validates():
    with pytest.raises(ValueError, match="time_budget_s"):
        TimeToTarget(0.9, time_budget_s=0)
    with pytest.raises(ValueError, match="mode"):
        TimeToTarget(0.9, mode="up")
    stopper = TimeToTarget(0.9)
    stopper.attach(_engine(0))
    with pytest.raises(RuntimeError, match="already attached"):
        stopper.attach(_engine(0))


@pytest.mark.gpu
def test_time_breakdown_cuda_sync_counts_gpu_time_as_compute():
    import torch

    a = torch.randn(4096, 4096, device="cuda")

    def step(e, b):
        for _ in range(20):
            a.matmul(a)  # queued asynchronously; only a sync makes it count

    engine = Engine(step)
    tb = TimeBreakdown(cuda_sync=True)
    tb.attach(engine)
    engine.run(list(range(5)), max_epochs=1)
    (ep,) = tb.epochs
    assert ep.compute_s > 10 * ep.data_s
