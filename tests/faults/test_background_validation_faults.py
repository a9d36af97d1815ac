"""Background validation when something fails: the error reaches the training thread, and no
validation thread outlives the run. Real MONAI engines on tiny tensors, real threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from monai.engines import SupervisedEvaluator, SupervisedTrainer

from monai_fast.handlers import BackgroundValidation, BackgroundValidationError
from monai_fast.handlers.validation_schedule import THREAD_NAME


class Flaky(torch.nn.Module):
    """Inference sleeps ``eval_s`` per batch and raises from the ``fail_at``-th batch on; training
    raises from the ``train_fail_at``-th step on."""

    def __init__(self, eval_s: float = 0.0, fail_at: int | None = None, train_fail_at: int | None = None) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 1, 1)
        self.eval_s, self.fail_at, self.train_fail_at = eval_s, fail_at, train_fail_at
        self.calls = {"eval": 0, "train": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = "train" if self.training else "eval"
        self.calls[mode] += 1
        limit = self.train_fail_at if self.training else self.fail_at
        if limit is not None and self.calls[mode] >= limit:
            raise ValueError(f"{mode} boom")
        if not self.training:
            time.sleep(self.eval_s)
        return self.conv(x)


def _engines(net: Flaky, max_epochs: int) -> tuple[SupervisedTrainer, SupervisedEvaluator]:
    batch = {"image": torch.rand(1, 1, 4, 4, 4), "label": torch.rand(1, 1, 4, 4, 4)}
    evaluator = SupervisedEvaluator(device="cpu", val_data_loader=[batch] * 3, network=net)
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=max_epochs,
        train_data_loader=[batch] * 3,
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
        loss_function=torch.nn.MSELoss(),
    )
    return trainer, evaluator


def _validation_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


def test_an_error_in_background_validation_is_raised_on_the_training_thread_naming_the_epoch():
    net = Flaky(fail_at=5)  # the 5th validation batch: the second validation, epoch 2's weights
    trainer, evaluator = _engines(net, max_epochs=6)
    BackgroundValidation(evaluator, when_busy="wait", threads=(1, 1)).attach(trainer)
    with pytest.raises(BackgroundValidationError, match="epoch 2") as info:
        trainer.run()
    assert isinstance(info.value.__cause__, ValueError) and "eval boom" in str(info.value.__cause__)
    assert trainer.state.epoch < 6  # raised during the run, not left for later
    assert _validation_threads() == []


def test_a_training_error_stops_the_running_background_validation():
    net = Flaky(eval_s=2.0, train_fail_at=5)  # validation would take 6 s; training fails in epoch 2
    trainer, evaluator = _engines(net, max_epochs=4)
    BackgroundValidation(evaluator, threads=(1, 1)).attach(trainer)
    with pytest.raises(ValueError, match="train boom"):
        trainer.run()
    assert _validation_threads() == []
    assert evaluator.network.calls["eval"] < 3  # stopped at its next batch, not run to the end
