"""The memory-format choice: decided from at least three interleaved rounds, a near-tie keeps the network's layout."""

from __future__ import annotations

import inspect
import math
import time

import pytest
import torch

from monai_fast.handlers import memory_format
from monai_fast.handlers.memory_format import choose_memory_format, in_channels_last_3d
from monai_fast.tune import rounds as rounds_module
from monai_fast.tune.rounds import measure_budget_s


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


def _steps(plain_s: float, last_s: float, planned_steps: int | None = None, net=None) -> tuple[int, str, str, dict]:
    net = net or _Timed(plain_s, last_s)
    counted = []
    # the measurement runs deep copies: count the copies' forward calls through the class
    original = _Timed.forward

    def counting(self, x):
        counted.append(1)
        return original(self, x)

    _Timed.forward = counting
    try:
        batch = {"image": torch.zeros(2, 2, 8, 8, 8)}
        choice, why, rounds = choose_memory_format(
            net, batch, "cpu", None, "auto", rounds=5, planned_steps=planned_steps
        )
    finally:
        _Timed.forward = original
    return len(counted), choice, why, rounds


#: one warm-up step in each layout (the baseline's also sizes the budget), nothing more
_BEFORE_ROUNDS = 2


def test_a_clear_loss_or_gain_is_decided_from_three_rounds_never_one():
    steps, choice, why, rounds = _steps(0.02, 0.2)  # channels_last clearly slower
    assert (steps, choice) == (_BEFORE_ROUNDS + 2 * 3, "contiguous"), why
    assert len(rounds["rounds_s"]) == 3 and rounds["choice"] == "contiguous"
    steps, choice, why, rounds = _steps(0.2, 0.02)  # clearly faster
    assert (steps, choice) == (_BEFORE_ROUNDS + 2 * 3, "channels_last_3d") and "median over 3 rounds" in why, why


def test_the_layout_the_network_is_in_is_the_baseline_a_near_tie_would_keep():
    # (a near-tie keeping the baseline is `decide`'s rule, tested with exact timings in test_rounds.py)
    net = _Timed(0.02, 0.2).to(memory_format=torch.channels_last_3d)  # the user's layout, clearly slower here
    assert in_channels_last_3d(net)
    steps, choice, why, rounds = _steps(0, 0, net=net)
    assert rounds["baseline"] == "channels_last_3d" and rounds["candidate"] == "contiguous"
    assert choice == "contiguous" and "contiguous faster" in why, why


def test_a_run_too_short_for_three_rounds_measures_none_and_keeps_the_layout(monkeypatch):
    # the floor scaled down with the step (0.2 s here, seconds for a large network on a CPU)
    monkeypatch.setattr(rounds_module, "MEASURE_MIN_S", 0.6)
    steps, choice, why, rounds = _steps(0.2, 0.02, planned_steps=6)  # 3 rounds would take 1.3 s of 0.6 s
    assert (steps, choice, rounds["rounds_s"]) == (_BEFORE_ROUNDS, "contiguous", []), why
    steps, choice, why, _ = _steps(0.2, 0.02, planned_steps=100_000)  # a long run measures its rounds
    assert (steps, choice) == (_BEFORE_ROUNDS + 2 * 3, "channels_last_3d"), why
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
        seen.update(inspect.signature(original).bind(*args, **kwargs).arguments)
        return original(*args, **kwargs)

    monkeypatch.setattr("monai_fast.handlers.fast_training.choose_memory_format", spy)
    fast = FastTraining(evaluator=False)
    fast.attach(trainer, evaluator)
    trainer.run()
    assert seen["planned_steps"] == 2 * trainer.state.epoch_length > 0 and seen["left_s"] is None
    assert "memory_format" in fast.applied
    for limit in (3600.0, lambda: 3600.0):  # a wall-clock limit, in seconds or as a function: 2 items whatever the plan
        trainer, evaluator = _user_trainer(tiny_files, max_epochs=2)
        FastTraining(evaluator=False, time_limit_s=limit).attach(trainer, evaluator)
        trainer.run()
        assert 0 < seen["left_s"] <= 3600.0
    trainer, evaluator = _user_trainer(tiny_files, max_epochs=2)
    FastTraining(evaluator=False, time_limit_s=lambda: None).attach(trainer, evaluator)  # the function says no limit
    trainer.run()
    assert seen["left_s"] is None


def test_a_network_with_handler_hooks_holding_a_lock_is_still_measured():
    """Handlers hook the network (autocast, timing) and hold locks and threads: the copies leave the hooks
    out instead of failing to copy them (which read as the network rejecting the layout)."""
    import threading

    class _Handler:
        def __init__(self):
            self.lock, self.calls = threading.Lock(), 0

        def before(self, module, args):
            with self.lock:
                self.calls += 1

    handler = _Handler()
    net = _Timed(0.02, 0.2)
    net.register_forward_pre_hook(handler.before)
    steps, choice, why, rounds = _steps(0, 0, net=net)
    assert choice == "contiguous" and rounds is not None and len(rounds["rounds_s"]) >= 3, why
    assert "rejects" not in why and handler.calls == 0  # the copies ran without the real network's hooks


def test_the_rounds_behind_the_layout_reach_the_record_and_the_doctors_report(tiny_files, tmp_path):
    """A real MONAI trainer with FastTraining and a run record: each timed round of the memory-format choice is in
    the record's summary and in the doctor's report, beside the decision."""
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining, RecordHandler, TimeBreakdown
    from monai_fast.report.doctor import doctor
    from monai_fast.telemetry.record import load_record

    trainer, evaluator = _user_trainer(tiny_files, max_epochs=1)
    record = RecordHandler(tmp_path / "run")
    record.attach(trainer)
    TimeBreakdown().attach(trainer)
    FastTraining(evaluator=False, compile=False).attach(trainer, evaluator)
    trainer.run()  # the record is closed at the run's end
    _, summary = load_record(tmp_path / "run")
    lever = summary["fast_training"]["memory_format"]
    rounds = lever["evidence"]["rounds_s"]
    assert len(rounds) >= 3 and all(len(r) == 2 and min(r) > 0 for r in rounds)
    doctor(tmp_path / "run")
    report = (tmp_path / "run" / "report.md").read_text()
    line = next(x for x in report.splitlines() if "FastTraining memory_format" in x)
    assert "[rounds, contiguous/channels_last_3d s: " in line and line.count("/") >= 1 + len(rounds), line


class _TurnsWithBatch(_Timed):
    """A step whose channels_last_3d variant is slower at 2 items and faster at 8 (a fixed cost, a smaller one per
    item), as a layout can tie or lose on a small batch and pay on the run's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
        n = x.shape[0]
        time.sleep(0.1 + 0.008 * n if last else 0.03 * n)  # 2 items: 0.116 s against 0.06 s; 8: 0.164 against 0.24
        return self.conv(x)


def test_a_long_plan_measures_at_the_runs_own_batch_a_short_or_unknown_one_at_two_items():
    batch = {"image": torch.zeros(8, 2, 8, 8, 8)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny convolution's own threads stall on a busy host; the sleeps decide
    try:
        cases = [(100_000, None, 8, "channels_last_3d"), (48, None, 2, "contiguous"), (None, None, 2, "contiguous")]
        cases.append((100_000, 3600.0, 2, "contiguous"))  # a long plan under a wall-clock limit: 2 items
        cases.append((100_000, math.inf, 8, "channels_last_3d"))  # a limit that never ends is none
        for planned, left_s, n, layout in cases:
            net = _TurnsWithBatch(0, 0)
            choice, why, rounds = choose_memory_format(net, batch, "cpu", None, planned_steps=planned, left_s=left_s)
            assert (choice, f"(batch ({n}, 2, 8, 8, 8))" in why) == (layout, True), (planned, left_s, why)
            assert len(rounds["rounds_s"]) >= 3
    finally:
        torch.set_num_threads(threads)


class _Oversized(_Timed):
    """A step on more than 2 items runs out of accelerator memory (a fake at the hardware edge)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x)


def test_a_whole_batch_that_runs_out_of_memory_is_measured_on_two_items():
    batch = {"image": torch.zeros(8, 2, 8, 8, 8)}
    choice, why, rounds = choose_memory_format(_Oversized(0.02, 0.2), batch, "cpu", None, planned_steps=100_000)
    assert choice == "contiguous" and "(batch (2, 2, 8, 8, 8))" in why and len(rounds["rounds_s"]) >= 3, why
