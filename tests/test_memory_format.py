"""The memory-format choice: decided from at least three interleaved rounds, a near-tie keeps the network's layout."""

from __future__ import annotations

import inspect
import math
import statistics
import time

import pytest
import torch
from ignite.engine import Events

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


def test_fast_training_chooses_the_layout_on_the_runs_own_iterations(tiny_files, monkeypatch):
    """A real MONAI trainer: FastTraining's layout comes from the run's own batches where the plan holds the rounds
    (one step of a copy checks that the network accepts the other layout, nothing more); a layout requested is
    checked on a copy, given the plan and the time limit."""
    from test_fast_training import _user_trainer

    from monai_fast.handlers import FastTraining

    copied = []
    monkeypatch.setattr(
        memory_format, "network_copy", lambda net: copied.append(net) or rounds_module.network_copy(net)
    )
    trainer, evaluator = _user_trainer(tiny_files, max_epochs=8)
    shapes = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: shapes.append(list(e.state.batch["image"].shape)))
    fast = FastTraining(evaluator=False, compile=False)
    fast.attach(trainer, evaluator)
    trainer.run()
    lever = fast.applied["memory_format"]
    assert "the run's own iterations" in lever["reason"] and len(copied) == 1, lever
    assert len(lever["evidence"]["rounds_s"]) >= 3 and lever["evidence"]["batch"] == shapes[0]
    trainer, evaluator = _user_trainer(tiny_files, max_epochs=2)  # fewer iterations than the rounds need
    fast = FastTraining(evaluator=False, compile=False)
    fast.attach(trainer, evaluator)
    trainer.run()
    assert "cannot hold a warm-up and 3 rounds" in fast.applied["memory_format"]["reason"] and len(copied) == 1
    seen = {}
    original = memory_format.choose_memory_format

    def spy(*args, **kwargs):
        seen.update(inspect.signature(original).bind(*args, **kwargs).arguments)
        return original(*args, **kwargs)

    monkeypatch.setattr(memory_format, "choose_memory_format", spy)
    trainer, evaluator = _user_trainer(tiny_files, max_epochs=2)
    FastTraining(evaluator=False, compile=False, memory_format="channels_last_3d", time_limit_s=3600.0).attach(
        trainer, evaluator
    )
    trainer.run()
    assert seen["planned_steps"] == 2 * trainer.state.epoch_length > 0 and 0 < seen["left_s"] <= 3600.0
    assert seen["request"] == "channels_last_3d" and len(copied) == 2  # one step on a copy: does it run?


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

    trainer, evaluator = _user_trainer(tiny_files, max_epochs=5)  # the rounds are the run's own iterations
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


class _WeightTimed(torch.nn.Module):
    """A real 3-D convolution whose forward takes ``plain_s`` with its weight contiguous and ``last_s`` with it in
    channels_last_3d, and notes the layout of each call (the run's own iterations: the input is not reordered)."""

    def __init__(self, plain_s: float, last_s: float):
        super().__init__()
        self.conv = torch.nn.Conv3d(2, 4, 3, padding=1)
        self.plain_s, self.last_s, self.seen = plain_s, last_s, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = in_channels_last_3d(self)
        self.seen.append("l" if last else "c")
        time.sleep(self.last_s if last else self.plain_s)
        return self.conv(x)


def _trainer(net, data, batch_size: int, epochs: int = 1, loss=None):
    """A real MONAI trainer of ``net`` (Adam, MSE unless ``loss``) over ``data``."""
    from monai.engines import SupervisedTrainer

    return SupervisedTrainer(
        device="cpu",
        max_epochs=epochs,
        train_data_loader=torch.utils.data.DataLoader(data, batch_size=batch_size),
        network=net,
        optimizer=torch.optim.Adam(net.parameters(), 1e-3),
        loss_function=loss or torch.nn.MSELoss(),
    )


def _layout_run(net, iterations: int, stop_after: int | None = None, items: int | None = None, epochs: int = 1):
    """A real MONAI trainer (Adam, a loss) on 5-D batches of 2 (``iterations`` of them, or of ``items`` a
    ``epochs`` times), with `LayoutChoice` attached; ``(choice, trainer)``."""
    from monai_fast.handlers.memory_format import LayoutChoice

    data = [{"image": torch.rand(2, 8, 8, 8), "label": torch.rand(4, 8, 8, 8)} for _ in range(items or 2 * iterations)]
    trainer = _trainer(net, data, 2, epochs)
    chosen = []
    choice = LayoutChoice(on_choice=lambda *a: chosen.append(a))
    choice.attach(trainer)
    if stop_after is not None:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop_after), lambda e: e.terminate())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny convolution's own threads stall on a busy host; the sleeps decide
    try:
        trainer.run()
    finally:
        torch.set_num_threads(threads)
    assert len(chosen) == 1 and chosen[0][0] == choice.layout  # said once
    return choice, trainer


def test_the_runs_own_iterations_alternate_in_rounds_and_the_faster_layout_stays():
    net = _WeightTimed(0.2, 0.02)  # channels_last_3d clearly faster
    choice, trainer = _layout_run(net, 12)
    assert choice.layout == "channels_last_3d" and "channels_last_3d faster" in choice.reason, choice.reason
    assert "the run's own iterations, batch (2, 2, 8, 8, 8)" in choice.reason
    # warm-ups (own, other), then rounds in alternating order, decided after three; then the layout kept
    assert "".join(net.seen) == "cl" + "cl" + "lc" + "cl" + "l" * 4, net.seen
    assert len(choice.evidence["rounds_s"]) == 3 and choice.evidence["batch"] == [2, 2, 8, 8, 8]
    assert choice.evidence["step_s"] == pytest.approx(statistics.median(r[1] for r in choice.evidence["rounds_s"]))
    # the optimizer trains the same weights on, its state in the layout kept
    optimizer = trainer.optimizer
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in net.parameters()]
    state = optimizer.state[net.conv.weight]
    assert all(state[k].is_contiguous(memory_format=torch.channels_last_3d) for k in ("exp_avg", "exp_avg_sq"))
    assert not state["exp_avg"].is_contiguous() and in_channels_last_3d(net)


class _ShortLast(_WeightTimed):
    """The same, with a batch of one item (an epoch's last) taking no time in either layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            self.seen.append("1")
            return self.conv(x)
        return super().forward(x)


def test_an_epochs_short_last_batch_is_timed_in_neither_layout():
    net = _ShortLast(0.2, 0.02)
    choice, _ = _layout_run(net, 0, items=5, epochs=4)  # batches of 2, 2 and 1 in each epoch
    # were a 1-item batch timed in either layout, a round would disagree and more than three would be needed
    assert choice.layout == "channels_last_3d" and len(choice.evidence["rounds_s"]) == 3, choice.reason
    assert "".join(net.seen[:12]) == "cl1cl1lc1cl1", net.seen


def test_a_slower_other_layout_goes_back_and_a_near_tie_keeps_the_networks_own():
    net = _WeightTimed(0.02, 0.2)
    choice, _ = _layout_run(net, 12)
    assert choice.layout == "contiguous" and net.seen[-4:] == ["c"] * 4, net.seen
    assert not in_channels_last_3d(net)
    net = _WeightTimed(0.25, 0.25).to(memory_format=torch.channels_last_3d)  # the user's layout, a tie
    choice, _ = _layout_run(net, 16)
    assert choice.layout == "channels_last_3d" and choice.reason.startswith("channels_last_3d kept"), choice.reason
    assert net.seen[:2] == ["l", "c"] and net.seen[-2:] == ["l", "l"] and in_channels_last_3d(net)


def test_a_run_too_short_for_the_rounds_or_ended_before_them_keeps_the_networks_layout():
    net = _WeightTimed(0.06, 0.01)
    choice, _ = _layout_run(net, 7)  # 2 warm-ups and 3 rounds of 2 need 8 iterations
    assert choice.layout == "contiguous" and "cannot hold a warm-up and 3 rounds" in choice.reason, choice.reason
    assert net.seen == ["c"] * 7 and choice.evidence is None
    net = _WeightTimed(0.06, 0.01)
    choice, trainer = _layout_run(net, 20, stop_after=5)  # terminated in the second round
    assert choice.layout == "contiguous" and "the run ended after 1 of the 3 rounds" in choice.reason, choice.reason
    assert "".join(net.seen) == "clcll" and not in_channels_last_3d(net)
    state = trainer.optimizer.state[net.conv.weight]
    assert state["exp_avg"].is_contiguous()  # moved back with the weights


class _FlatParameter(_WeightTimed):
    """A 4-D parameter beside the 3-D convolution: ``channels_last_3d`` cannot be applied to the whole network."""

    def __init__(self, *times: float):
        super().__init__(*times)
        self.flat = torch.nn.Parameter(torch.zeros(2, 2, 1, 1))


class _ViewsItsOutput(_WeightTimed):
    """A forward that calls ``view`` on a convolution's output, which fails when the output is channels_last_3d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out.view(out.shape[0], -1).view(out.shape)  # flattening needs contiguous memory


@pytest.mark.parametrize("net_class", [_FlatParameter, _ViewsItsOutput])
def test_a_network_that_cannot_train_in_channels_last_3d_keeps_its_layout_and_the_run_goes_on(net_class):
    net = net_class(0.2, 0.02)  # were it measured, channels_last_3d would win
    net.seen = []
    choice, trainer = _layout_run(net, 10)
    assert choice.layout == "contiguous" and "the network rejects channels_last_3d" in choice.reason, choice.reason
    assert net.seen == ["c"] * 10 and trainer.state.iteration == 10  # the run's own steps never tried it


def test_batches_that_keep_changing_shape_settle_the_networks_layout_and_a_later_full_batch_is_awaited():
    from monai_fast.handlers.memory_format import LayoutChoice

    net = _WeightTimed(0.02, 0.002)
    data = [{"image": torch.rand(2, s, 8, 8), "label": torch.rand(4, s, 8, 8)} for s in range(6, 30)]
    trainer = _trainer(net, data, 1, loss=lambda out, y: out.mean())
    choice = LayoutChoice()
    choice.attach(trainer)
    trainer.run()
    assert choice.layout == "contiguous" and "batches differed from the first one's shape" in choice.reason
    assert set(net.seen[2:]) == {"c"} and choice.settled_at({"image": torch.zeros(1, 2, 9, 8, 8)})


def test_a_short_last_batch_is_not_where_a_step_is_measured_after_the_rounds():
    net = _ShortLast(0.2, 0.02)
    choice, _ = _layout_run(net, 0, items=5, epochs=4)
    assert choice.settled_at({"image": torch.zeros(2, 2, 8, 8, 8)})
    assert not choice.settled_at({"image": torch.zeros(1, 2, 8, 8, 8)})


def test_detached_while_measuring_puts_the_network_and_its_optimizer_state_back():
    from monai_fast.handlers.memory_format import LayoutChoice

    net = _WeightTimed(0.02, 0.002)
    trainer = _trainer(net, [{"image": torch.rand(2, 8, 8, 8), "label": torch.rand(4, 8, 8, 8)} for _ in range(20)], 2)
    choice = LayoutChoice()
    choice.attach(trainer)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda e: choice.detach(e))  # after the other's
    trainer.run()
    assert net.seen[:2] == ["c", "l"] and set(net.seen[2:]) == {"c"} and not in_channels_last_3d(net)
    assert trainer.optimizer.state[net.conv.weight]["exp_avg"].is_contiguous()


def test_layout_choice_options_are_checked():
    from monai_fast.handlers.memory_format import LayoutChoice

    with pytest.raises(ValueError, match="request must be 'auto'"):
        LayoutChoice("channels_last")
    with pytest.raises(ValueError, match="max_rounds must be >= 3"):
        LayoutChoice(max_rounds=2)


def test_the_input_of_a_batch_without_an_image_key_is_its_largest_tensor_not_an_id():
    from monai_fast.handlers.throughput import batch_shape

    volume = torch.zeros(2, 1, 8, 8, 8)
    assert batch_shape({"id": torch.arange(2), "img": volume, "seg": volume[:, :, :4]}) == (2, 1, 8, 8, 8)
    assert batch_shape((torch.arange(2), volume)) == (2, 1, 8, 8, 8)
    assert batch_shape({"image": torch.zeros(2, 3), "seg": volume}) == (2, 3)  # "image" is the input, as named
    assert memory_format._unmeasured(torch.nn.Conv3d(1, 2, 3), {"id": torch.arange(2), "img": volume}, "auto") is None
