"""The memory-format choice measures no more rounds than it needs: a clear answer after one round stops it."""

from __future__ import annotations

import time

import torch

from monai_fast.handlers.memory_format import MIN_GAIN, choose_memory_format, settled


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


def _steps(plain_s: float, last_s: float) -> tuple[int, str, str]:
    net = _Timed(plain_s, last_s)
    counted = []
    # the measurement runs deep copies: count the copies' forward calls through the class
    original = _Timed.forward

    def counting(self, x):
        counted.append(1)
        return original(self, x)

    _Timed.forward = counting
    try:
        choice, why = choose_memory_format(net, {"image": torch.zeros(2, 2, 8, 8, 8)}, "cpu", None, "auto", rounds=3)
    finally:
        _Timed.forward = original
    return len(counted), choice, why


def test_a_clear_loss_or_gain_stops_after_one_round_and_a_close_call_runs_every_round():
    steps, choice, why = _steps(0.01, 0.08)  # channels_last clearly slower
    assert (steps, choice) == (2 + 2, "contiguous"), why  # the warm-up pair, then one timed pair
    steps, choice, why = _steps(0.08, 0.01)  # clearly faster
    assert (steps, choice) == (2 + 2, "channels_last_3d") and "median of 1" in why, why
    steps, choice, why = _steps(0.03, 0.03)  # too close to call after one round: all three
    assert (steps, choice) == (2 + 2 * 3, "contiguous"), why


def test_settled_needs_a_margin_around_the_threshold():
    assert settled([1.0], [0.5]) and settled([1.0], [1.6])
    assert not settled([1.0], [1.0 / MIN_GAIN]) and not settled([1.0], [1.02]) and not settled([], [])
