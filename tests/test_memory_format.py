"""The memory-format choice measures no more rounds than it needs: a clear answer after one round stops it."""

from __future__ import annotations

import time

import pytest
import torch

from monai_fast.handlers import memory_format
from monai_fast.handlers.memory_format import MIN_GAIN, choose_memory_format, measure_budget_s, settled


class _Timed(torch.nn.Module):
    """A real 3-D convolution whose step takes ``plain_s`` in the default layout and ``last_s`` in channels_last."""

    def __init__(self, plain_s: float, last_s: float):
        super().__init__()
        self.conv = torch.nn.Conv3d(2, 4, 3, padding=1)
        self.plain_s, self.last_s, self.calls = plain_s, last_s, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        last = x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
        time.sleep(self.last_s if last else self.plain_s)
        return self.conv(x)


def _steps(plain_s: float, last_s: float, planned_steps: int | None = None) -> tuple[int, str, str]:
    net = _Timed(plain_s, last_s)
    counted = []
    # the measurement runs deep copies: count the copies' forward calls through the class
    original = _Timed.forward

    def counting(self, x):
        counted.append(1)
        return original(self, x)

    _Timed.forward = counting
    try:
        batch = {"image": torch.zeros(2, 2, 8, 8, 8)}
        choice, why = choose_memory_format(net, batch, "cpu", None, "auto", rounds=3, planned_steps=planned_steps)
    finally:
        _Timed.forward = original
    return len(counted), choice, why


def test_a_clear_loss_or_gain_stops_after_one_round_and_a_close_call_runs_every_round():
    steps, choice, why = _steps(0.02, 0.2)  # channels_last clearly slower
    assert (steps, choice) == (2 + 2, "contiguous"), why  # the warm-up pair, then one timed pair
    steps, choice, why = _steps(0.2, 0.02)  # clearly faster
    assert (steps, choice) == (2 + 2, "channels_last_3d") and "median of 1" in why, why
    steps, choice, why = _steps(0.2, 0.2 / 1.1)  # 1.1x: too close to call after one round, all three
    assert steps == 2 + 2 * 3, why  # (which layout wins a 1.1x near-tie is not the point)


def test_settled_needs_a_margin_around_the_threshold():
    assert settled([1.0], [0.5]) and settled([1.0], [1.6])
    assert not settled([1.0], [1.0 / MIN_GAIN]) and not settled([1.0], [1.02]) and not settled([], [])


def test_a_near_tie_measures_every_round_for_a_long_run_and_one_for_a_short_one(monkeypatch):
    # the floor scaled down with the step (0.2 s here, seconds for a large network on a CPU)
    monkeypatch.setattr(memory_format, "MEASURE_MIN_S", 0.6)
    assert _steps(0.2, 0.2 / 1.1, planned_steps=6)[0] == 2 + 2  # a 6-step run: its budget ends after one round
    assert _steps(0.2, 0.2 / 1.1, planned_steps=100_000)[0] == 2 + 2 * 3  # a long one: every round
    assert measure_budget_s(None, 5.0) == float("inf") and measure_budget_s(6, 65.0) == pytest.approx(3.9)


def test_fast_training_bounds_the_measurement_by_the_runs_planned_steps(tiny_files, monkeypatch):
    """FastTraining passes the trainer's max_epochs x epoch_length (a real MONAI trainer, 2 epochs); the real
    measurement runs under the spy."""
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining

    trainer, evaluator = _user_trainer(tiny_files, max_epochs=2)
    seen = {}
    original = memory_format.choose_memory_format

    def spy(*args, **kwargs):
        seen["planned_steps"] = kwargs.get("planned_steps")
        return original(*args, **kwargs)

    monkeypatch.setattr("monai_fast.handlers.fast_training.choose_memory_format", spy)
    fast = FastTraining(evaluator=False)
    fast.attach(trainer, evaluator)
    trainer.run()
    assert seen["planned_steps"] == 2 * trainer.state.epoch_length > 0
    assert "memory_format" in fast.applied
