"""InferenceSplit (issue 18, item 7): a validation's time split into network, sliding window around it, before and
after, on real MONAI engines; counted for validation only when the trainer shares the network; read by the doctor."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from ignite.engine import Engine
from monai.data import DataLoader, Dataset
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import ValidationHandler
from monai.inferers import SlidingWindowInferer

from monai_fast.handlers import InferenceSplit, RecordHandler, TimeBreakdown
from monai_fast.report.doctor import doctor

NET_SLEEP_S, POST_SLEEP_S, STITCH_SLEEP_S = 0.02, 0.05, 0.05
ROI, SHAPE, SW_BATCH = (8, 8, 8), (16, 16, 16), 2
WINDOWS = 8  # a 16^3 volume in 8^3 windows without overlap: 2 x 2 x 2


class SlowConv(torch.nn.Module):
    """A real 3-D convolution whose forward also sleeps, so network time has a known lower bound."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(NET_SLEEP_S)
        return self.conv(x)


def _items(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {"image": torch.rand(1, *SHAPE, generator=g), "label": torch.rand(1, *SHAPE, generator=g)} for _ in range(n)
    ]


def _slow_post(batch):
    time.sleep(POST_SLEEP_S)
    return batch


class SlowStitching(SlidingWindowInferer):
    """MONAI's sliding window, then extra work before it returns, as a heavy stitching step would be."""

    def __call__(self, inputs, network, *args, **kwargs):
        out = super().__call__(inputs, network, *args, **kwargs)
        time.sleep(STITCH_SLEEP_S)
        return out


def _evaluator(net: torch.nn.Module, volumes: int = 2) -> SupervisedEvaluator:
    return SupervisedEvaluator(
        device="cpu",
        val_data_loader=DataLoader(Dataset(_items(volumes)), batch_size=1),
        network=net,
        inferer=SlowStitching(ROI, sw_batch_size=SW_BATCH, overlap=0.0),
        postprocessing=_slow_post,
    )


def test_each_validation_is_split_into_network_windows_and_the_post_processing_after_the_inferer():
    split = InferenceSplit()
    evaluator = _evaluator(SlowConv())
    split.attach(evaluator)
    evaluator.run()
    evaluator.run()
    assert len(split.runs) == 2
    t = split.runs[-1]
    calls = math.ceil(WINDOWS / SW_BATCH)
    assert (t.iterations, t.network_calls, t.windows) == (2, 2 * calls, 2 * WINDOWS)
    assert t.network_s >= 2 * calls * NET_SLEEP_S * 0.95
    assert t.after_s >= 2 * POST_SLEEP_S * 0.95  # MONAI's post-processing runs after FORWARD_COMPLETED
    assert t.sliding_window_s >= 2 * STITCH_SLEEP_S * 0.95  # the inferer's own work after its last window
    assert t.network_s < t.iteration_s and t.after_s < t.iteration_s
    assert t.sliding_window_s >= 0 and t.before_s >= 0


def test_a_network_shared_with_the_trainer_is_timed_for_validation_only():
    net = SlowConv()
    evaluator = _evaluator(net, volumes=1)
    trainer = SupervisedTrainer(
        device="cpu",
        max_epochs=2,
        train_data_loader=DataLoader(Dataset(_items(3)), batch_size=1),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=torch.nn.MSELoss(),
        train_handlers=[ValidationHandler(validator=evaluator, interval=1)],
    )
    split = InferenceSplit()
    split.attach(evaluator)
    trainer.run()
    assert len(split.runs) == 2
    assert [r.network_calls for r in split.runs] == [
        math.ceil(WINDOWS / SW_BATCH)
    ] * 2  # 3 training calls/epoch not counted


def test_calls_from_another_thread_during_validation_are_not_counted():
    net = SlowConv()
    evaluator = _evaluator(net, volumes=2)
    split = InferenceSplit()
    split.attach(evaluator)
    worker = threading.Thread(target=evaluator.run)
    worker.start()
    other = 0
    with torch.no_grad():
        while worker.is_alive():  # a training thread using the same module meanwhile
            net(torch.rand(1, 1, *ROI))
            other += 1
    worker.join()
    assert other > 0 and split.runs[-1].network_calls == 2 * math.ceil(WINDOWS / SW_BATCH)


def test_a_plain_ignite_engine_needs_the_network_named_and_then_is_split_without_forward_completed():
    net = SlowConv()
    engine = Engine(lambda e, batch: net(batch))
    with pytest.raises(ValueError, match="network="):
        InferenceSplit().attach(engine)
    split = InferenceSplit(network=net)
    split.attach(engine)
    engine.run([torch.rand(2, 1, *ROI)] * 3, max_epochs=1)
    t = split.runs[-1]
    assert (t.iterations, t.network_calls, t.windows) == (3, 3, 6) and t.network_s >= 3 * NET_SLEEP_S * 0.95


def test_detach_removes_the_forward_hooks():
    net = SlowConv()
    evaluator = _evaluator(net, volumes=1)
    split = InferenceSplit()
    split.attach(evaluator)
    assert net._forward_hooks and net._forward_pre_hooks
    split.detach(evaluator)
    assert not net._forward_hooks and not net._forward_pre_hooks


def test_the_doctor_reports_network_and_stitching_shares_from_the_split(tmp_path):
    for name, attach_split in (("split", True), ("plain", False)):
        record = RecordHandler(tmp_path / name)
        net = SlowConv()
        evaluator = _evaluator(net, volumes=1)
        trainer = SupervisedTrainer(
            device="cpu",
            max_epochs=1,
            train_data_loader=DataLoader(Dataset(_items(2)), batch_size=1),
            network=net,
            optimizer=torch.optim.SGD(net.parameters(), 0.01),
            loss_function=torch.nn.MSELoss(),
            train_handlers=[ValidationHandler(validator=evaluator, interval=1)],
        )
        record.attach(trainer)
        record.attach(evaluator)
        TimeBreakdown().attach(trainer)
        if attach_split:
            InferenceSplit().attach(evaluator)
        trainer.run()
    d = doctor(tmp_path / "split")
    split = d.numbers["inference"]["split"]
    assert split["windows"] == WINDOWS and split["network_s"] >= math.ceil(WINDOWS / SW_BATCH) * NET_SLEEP_S * 0.95
    assert sum(split["shares"].values()) == pytest.approx(1.0)
    assert f"network {100 * split['shares']['network_s']:.0f}%" in d.text()
    assert "## Inference" in (tmp_path / "split" / "report.md").read_text()
    d = doctor(tmp_path / "plain")
    assert "split" not in d.numbers["inference"] and "Attach monai_fast.handlers.InferenceSplit" in d.text()


def test_a_network_that_is_never_called_warns_once(caplog):
    evaluator = _evaluator(SlowConv(), volumes=1)
    split = InferenceSplit(network=torch.nn.Conv3d(1, 1, 1))  # not the module the inferer calls
    split.attach(evaluator)
    with caplog.at_level("WARNING", logger="monai_fast.handlers"):
        evaluator.run()
        evaluator.run()
    assert sum("was not called" in r.getMessage() for r in caplog.records) == 1
    assert split.runs[-1].network_calls == 0 and split.runs[-1].after_s > 0
