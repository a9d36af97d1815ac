"""The user's training post-processing and metrics: kept, timed per epoch, and named by the doctor when they cost.

Real parts: MONAI ``SupervisedTrainer`` s with a training ``postprocessing`` (``Activationsd``,
``AsDiscreted``, a ``Lambdad`` that does deliberate work) and an ignite ``Accuracy`` as
``key_train_metric``, ``FastTraining`` + ``RecordHandler`` + ``TimeBreakdown``, the doctor on the
written record; and the Model Zoo-layout bundle ``tests/bundles/seg3d`` (a training ``Accuracy``
over ``Activationsd/AsDiscreted``) through ``run_bundle``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from ignite.engine import Events
from ignite.metrics import Accuracy
from monai.engines import SupervisedTrainer
from monai.handlers import from_engine
from monai.transforms import Activationsd, AsDiscreted, Compose, Lambdad
from torch.utils.data import DataLoader

from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.bundle import run_bundle
from monai_fast.handlers import FastTraining, RecordHandler, TimeBreakdown, TrainingAlgorithmTime
from monai_fast.handlers.lifecycle import callbacks_on
from monai_fast.report.doctor import doctor
from monai_fast.telemetry.record import load_record, select

ROOT = Path(__file__).resolve().parents[1]
SLEEP_S = 0.03  # per item: the deliberate work of the slow post-processing


def _loss(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(pred, label[:, 0].long())


def _data(n: int = 8, size: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {"image": torch.randn(1, size, size, generator=g), "label": torch.randint(0, 2, (1, size, size), generator=g)}
        for _ in range(n)
    ]


def _slow(x: torch.Tensor) -> torch.Tensor:
    time.sleep(SLEEP_S)
    return x


def _slow_trainer(epochs: int = 2) -> SupervisedTrainer:
    """A trainer as the spleen bundle writes one: softmax + argmax post-processing and an Accuracy on each batch."""
    net = torch.nn.Conv2d(1, 2, 3, padding=1)
    post = Compose(
        [
            Activationsd(keys="pred", softmax=True),
            AsDiscreted(keys=["pred", "label"], argmax=[True, False], to_onehot=2),
            Lambdad(keys="pred", func=_slow),
        ]
    )
    return SupervisedTrainer(
        device="cpu",
        max_epochs=epochs,
        train_data_loader=DataLoader(_data(), batch_size=2),
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.1),
        loss_function=_loss,
        postprocessing=post,
        key_train_metric={"train_acc": Accuracy(output_transform=from_engine(["pred", "label"]))},
    )


def _cheap_trainer(epochs: int = 2) -> SupervisedTrainer:
    """A trainer whose step outweighs its metric: an Accuracy on the batch's logits, no post-processing."""
    net = torch.nn.Sequential(
        *[torch.nn.Conv2d(c, 64, 3, padding=1) for c in (1, 64, 64, 64)], torch.nn.Conv2d(64, 2, 1)
    )
    return SupervisedTrainer(
        device="cpu",
        max_epochs=epochs,
        train_data_loader=DataLoader(_data(n=32, size=96), batch_size=4),  # 8 steps: a busy machine's stall averages
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=_loss,
        decollate=False,
        key_train_metric={"train_acc": Accuracy(output_transform=lambda out: (out["pred"], out["label"][:, 0].long()))},
    )


def _run(trainer: SupervisedTrainer, run_dir: Path) -> FastTraining:
    record = RecordHandler(run_dir)
    record.attach(trainer)
    TimeBreakdown().attach(trainer)
    fast = FastTraining(precision=False, memory_format=False)
    fast.attach(trainer)
    trainer.run()
    return fast


def test_fast_training_times_a_slow_training_postprocessing_and_the_doctor_names_it(tmp_path):
    trainer = _slow_trainer()
    _run(trainer, tmp_path)
    assert 0.0 <= trainer.state.metrics["train_acc"] <= 1.0  # the user's metric is kept and computed
    rows, _ = load_record(tmp_path)
    epochs = select(rows, "epoch", "training_algorithm", engine="train")
    assert [r["epoch"] for r in epochs] == [1, 2]
    for r in epochs:
        assert r["iterations"] == 4
        assert r["postprocessing_s"] >= 8 * SLEEP_S  # every item of the epoch went through the slow transform
        assert r["metrics_s"] > 0
        assert r["postprocessing_s"] + r["metrics_s"] < r["epoch_s"]
        assert r["metrics"] == ["Accuracy"]
        assert r["postprocessing"] == ["Activationsd", "AsDiscreted", "Lambdad"]
    diagnosis = doctor(tmp_path)
    said = [e for e in diagnosis.evidence if "training algorithm" in e]
    assert len(said) == 1, diagnosis.evidence
    assert "Activationsd/AsDiscreted/Lambdad" in said[0] and "Accuracy" in said[0]
    assert "s per epoch" in said[0]
    assert "every N iterations" in diagnosis.fixes[0] and "only at validation" in diagnosis.fixes[0]
    assert diagnosis.numbers["training_algorithm"]["share"] >= 0.10
    assert "Accuracy" in Path(diagnosis.report).read_text()


def test_a_cheap_training_metric_is_timed_and_the_doctor_says_nothing_of_it(tmp_path):
    trainer = _cheap_trainer()
    _run(trainer, tmp_path)
    rows, _ = load_record(tmp_path)
    epochs = select(rows, "epoch", "training_algorithm", engine="train")
    assert len(epochs) == 2 and all(r["metrics"] == ["Accuracy"] and r["metrics_s"] > 0 for r in epochs)
    shares = sorted(r["metrics_s"] / r["epoch_s"] for r in epochs)  # the doctor reads the median, as here
    assert sum(shares) / len(shares) < 0.10, shares
    diagnosis = doctor(tmp_path)
    assert not any("training algorithm" in e for e in diagnosis.evidence)
    assert not any("every N iterations" in f for f in diagnosis.fixes)
    assert "training_algorithm" not in diagnosis.numbers


def test_the_timers_stand_in_place_and_detaching_puts_the_originals_back():
    trainer = _slow_trainer(epochs=1)
    before = {e: callbacks_on(trainer, e) for e in (Events.ITERATION_COMPLETED, Events.EPOCH_COMPLETED)}
    metric = before[Events.ITERATION_COMPLETED][0].__self__
    timer = TrainingAlgorithmTime()
    timer.attach(trainer)
    during = {e: callbacks_on(trainer, e) for e in before}
    assert during[Events.ITERATION_COMPLETED][0] != before[Events.ITERATION_COMPLETED][0]  # wrapped, same place
    assert metric.is_attached(trainer)  # ignite still sees the metric's own callbacks
    assert timer.timed == ["Activationsd", "AsDiscreted", "Lambdad", "Accuracy"]
    trainer.run()
    assert len(timer.epochs) == 1 and timer.epochs[0].postprocessing_s >= 8 * SLEEP_S
    timer.detach(trainer)
    assert {e: callbacks_on(trainer, e)[: len(before[e])] for e in before} == before
    trained = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: trained.append(e.state.epoch))
    trainer.run()  # a second run, unwrapped: it trains an epoch and nothing more is timed
    assert trained == [1] and len(timer.epochs) == 1


def test_a_bundles_training_accuracy_is_timed_in_its_record(tmp_path):
    data = generate_msd(tmp_path / "data", num_cases=3, shape=(32, 32, 24), progress=False)
    bundle = tmp_path / "seg3d"
    shutil.copytree(ROOT / "tests" / "bundles" / "seg3d", bundle)
    from bundle_parts import small  # the seg3d bundle's sizes for a small CPU, one home

    result = run_bundle(bundle, overrides=small(data), logging_file=False, doctor=False)
    rows, _ = load_record(result.run_dir)
    epochs = select(rows, "epoch", "training_algorithm", engine="train")
    assert len(epochs) == 1
    assert epochs[0]["metrics"] == ["Accuracy"]
    assert epochs[0]["postprocessing"] == ["Activationsd", "AsDiscreted"]
    assert 0 < epochs[0]["postprocessing_s"] + epochs[0]["metrics_s"] < epochs[0]["epoch_s"]
