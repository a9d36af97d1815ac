"""Validation off the critical path: the schedule, background validation, time to first and stable
target. Real MONAI SupervisedTrainer / SupervisedEvaluator on tiny tensors."""

from __future__ import annotations

import threading
import time

import torch
from ignite.engine import Events
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import MeanDice, ValidationHandler, from_engine
from monai.transforms import AsDiscreted, Compose

from monai_fast.handlers import BackgroundValidation, RecordHandler, TimeToTarget, ValidationSchedule
from monai_fast.handlers.validation_schedule import estimator_like
from monai_fast.telemetry.record import Kind, Source, select

SHAPE = (8, 8, 8)


class Oracle(torch.nn.Module):
    """Segments a case perfectly when its difficulty (channel 1) is <= ``skill``, else finds nothing:
    the mean Dice of a set is the share of its cases at or below the skill."""

    def __init__(self) -> None:
        super().__init__()
        self.skill = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask, difficulty = x[:, :1], x[:, 1:2]
        fg = torch.where(difficulty <= self.skill, 2 * mask - 1, -torch.ones_like(mask))
        return torch.cat([-fg, fg], dim=1)


def _case(difficulty: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    label = (torch.rand(1, 1, *SHAPE, generator=g) > 0.5).float()
    return {"image": torch.cat([label, torch.full_like(label, difficulty)], dim=1), "label": label}


def _metric() -> dict:
    return {"dice": MeanDice(include_background=False, output_transform=from_engine(["pred", "label"]))}


def _post() -> Compose:
    return Compose([AsDiscreted(keys="pred", argmax=True, to_onehot=2), AsDiscreted(keys="label", to_onehot=2)])


def _evaluator(network: torch.nn.Module, cases: list[dict]) -> SupervisedEvaluator:
    return SupervisedEvaluator(
        device="cpu", val_data_loader=cases, network=network, postprocessing=_post(), key_val_metric=_metric()
    )


def _trainer(network: torch.nn.Module, max_epochs: int, handlers: list | None = None, n: int = 2) -> SupervisedTrainer:
    g = torch.Generator().manual_seed(1)
    data = [
        {"image": torch.rand(2, 1, *SHAPE, generator=g), "label": (torch.rand(2, *SHAPE, generator=g) > 0.5).long()}
        for _ in range(n)
    ]
    return SupervisedTrainer(
        device="cpu",
        max_epochs=max_epochs,
        train_data_loader=data,
        network=network,
        optimizer=torch.optim.SGD(network.parameters(), lr=0.1),
        loss_function=torch.nn.CrossEntropyLoss(),
        train_handlers=handlers or [],
    )


def _scheduled(skills: list[float], difficulties: list[float], every: int, margin: float):
    """A trainer whose oracle has ``skills[epoch - 1]`` after each epoch, a full evaluator over
    ``difficulties`` and an estimator over the first case only."""
    oracle = Oracle()
    cases = [_case(d, i) for i, d in enumerate(difficulties)]
    evaluator = _evaluator(oracle, cases)
    estimator = estimator_like(evaluator, cases[:1], _metric(), _post())
    trainer = _trainer(torch.nn.Conv3d(1, 2, 1), max_epochs=len(skills))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: setattr(oracle, "skill", skills[e.state.epoch - 1]))
    schedule = ValidationSchedule(evaluator, estimator, target=0.9, margin=margin, every=every, metric_name="dice")
    schedule.attach(trainer)
    stopper = TimeToTarget(0.9, metric_name="dice")
    stopper.attach(trainer, evaluator)
    return trainer, schedule, stopper


def test_schedule_skips_full_validation_while_estimate_is_far_then_runs_it_every_epoch(tmp_path):
    # the estimator's case (difficulty 0.1) is solved from epoch 5 on: estimate 0, 0, 0, 0, 1, 1, 1
    trainer, schedule, stopper = _scheduled([0.0] * 4 + [0.5] * 3, [0.1, 0.4, 0.6, 0.9], every=2, margin=0.1)
    record = RecordHandler(None)
    record.attach(trainer)
    trainer.run()
    assert trainer.state.epoch == 7
    assert schedule.full_epochs == [2, 4, 5, 6, 7]
    assert schedule.close_epoch == 5
    assert schedule.estimates == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0), (5, 1.0)]  # no estimate once close
    assert [(epoch, v) for _, epoch, v in stopper.history] == [(2, 0.0), (4, 0.0), (5, 0.5), (6, 0.5), (7, 0.5)]
    rows = select(record.record.rows, Kind.EPOCH, Source.VALIDATION)
    assert [r["full"] for r in rows] == [False, True, False, True, True, True, True]


def test_target_is_declared_only_by_a_full_validation_not_by_the_estimate():
    # the estimate (one easy case) is 1.0 >= 0.9 from epoch 1; the full set is at 0.5
    trainer, schedule, stopper = _scheduled([0.5] * 4, [0.1, 0.4, 0.6, 0.9], every=10, margin=0.0)
    trainer.run()
    assert schedule.estimates[0] == (1, 1.0)
    assert schedule.full_epochs == [1, 2, 3, 4]
    assert stopper.reached_s is None and stopper.stable_s is None
    assert trainer.state.epoch == 4  # never stopped: the target was not reached


def test_stable_target_needs_two_consecutive_full_validations_at_target():
    oracle = Oracle()
    skills = [0.2, 1.0, 0.5, 1.0, 1.0, 1.0]  # full Dice 0.25, 1, 0.5, 1, 1, 1
    evaluator = _evaluator(oracle, [_case(d, i) for i, d in enumerate([0.1, 0.4, 0.6, 0.9])])
    trainer = _trainer(torch.nn.Conv3d(1, 2, 1), len(skills))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: setattr(oracle, "skill", skills[e.state.epoch - 1]))
    ValidationHandler(validator=evaluator, interval=1).attach(trainer)
    stopper = TimeToTarget(0.9, metric_name="dice", stop_on="stable")
    stopper.attach(trainer, evaluator)
    trainer.run()
    assert (stopper.reached_epoch, stopper.stable_epoch) == (2, 5)
    assert 0 <= stopper.reached_s <= stopper.stable_s
    assert trainer.state.epoch == 5  # stopped at the stable target, not the first


class SlowEvalNet(torch.nn.Module):
    """A tiny segmentation network whose inference is slow, so training moves on meanwhile."""

    def __init__(self, eval_delay_s: float = 0.0) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 2, 3, padding=1)
        self.norm = torch.nn.BatchNorm3d(2)
        self.eval_delay_s = eval_delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            time.sleep(self.eval_delay_s)
        return self.norm(self.conv(x))


def _val_cases(n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    return [
        {"image": torch.rand(1, 1, *SHAPE, generator=g), "label": (torch.rand(1, 1, *SHAPE, generator=g) > 0.5).float()}
        for _ in range(n)
    ]


def test_background_validation_equals_sync_validation_of_the_same_snapshot_and_epoch():
    torch.manual_seed(0)
    net = SlowEvalNet(eval_delay_s=0.05)
    trainer = _trainer(net, max_epochs=6, n=4)
    snapshots: dict[int, dict] = {}
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED,
        lambda e: snapshots.update({e.state.epoch: {k: v.clone() for k, v in net.state_dict().items()}}),
    )
    evaluator = _evaluator(net, _val_cases())
    background = BackgroundValidation(evaluator, threads=(1, 1))
    background.attach(trainer)
    stopper = TimeToTarget(2.0, metric_name="dice")  # never reached: every reading is kept
    stopper.attach(trainer, evaluator)
    trainer.run()
    assert evaluator.network is not net  # validated a private copy
    assert background.validated_epochs[-1] == 6 and len(background.validated_epochs) >= 2
    assert [epoch for _, epoch, _ in stopper.history] == background.validated_epochs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the validation thread's setting
    try:
        for _, epoch, value in stopper.history:
            replay = SlowEvalNet()
            replay.load_state_dict(snapshots[epoch])
            sync = _evaluator(replay, _val_cases())
            sync.run(epoch)
            assert sync.state.metrics["dice"] == value, f"epoch {epoch}"  # bit-equal, CPU fp32
    finally:
        torch.set_num_threads(threads)
    assert len({v for _, _, v in stopper.history}) > 1  # the weights did change between snapshots


def test_background_validation_skips_epochs_while_busy_and_counts_wall_clock_at_arrival():
    net = SlowEvalNet(eval_delay_s=0.3)  # one validation (2 cases) takes at least 0.6 s
    trainer = _trainer(net, max_epochs=4, n=1)
    evaluator = _evaluator(net, _val_cases())
    background = BackgroundValidation(evaluator, threads=(1, 1))
    background.attach(trainer)
    # the first validation outlasts epochs 2 and 3 whatever the host's load: it starts once epoch 3 has
    # ended (after the handler above looked at it); a validation on the training thread would wait 30 s
    # here, then skip nothing
    epoch_3_done = threading.Event()
    evaluator.add_event_handler(Events.STARTED, lambda e: epoch_3_done.wait(timeout=30))
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=3), lambda e: epoch_3_done.set())
    stopper = TimeToTarget(-1.0, metric_name="dice", mode="min")  # never reached
    stopper.attach(trainer, evaluator)
    start = time.perf_counter()
    trainer.run()
    wall = time.perf_counter() - start
    assert background.validated_epochs[0] == 1 and background.validated_epochs[-1] == 4
    assert background.validated_epochs == [1, 4] and background.skipped_epochs == [2, 3]
    # the readings arrive in order, each at least one validation (0.6 s) after the run began
    arrivals = [t for t, _, _ in stopper.history]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0.6
    assert stopper.history[-1][0] <= stopper.elapsed() and wall >= 0.6 * len(background.validated_epochs)
