"""The doctor accounts for a run's whole wall clock: set-up, compute, data wait, validation, checkpoints,
handlers, idle, with shares summing to 100 %, and the work beside training listed apart."""

from __future__ import annotations

import copy
import json
import threading
import time

import pytest
import torch
from ignite.engine import Events
from monai.data import DataLoader, Dataset
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import ValidationHandler
from monai.transforms import Lambdad

from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.training.run import run_to_target
from monai_fast.handlers import RecordHandler, TimeBreakdown
from monai_fast.handlers.checkpoint_folder import CheckpointFolder
from monai_fast.report.advice import ATTACH
from monai_fast.report.doctor import diagnose, doctor
from monai_fast.report.wall_clock import SHARES, wall_clock
from monai_fast.telemetry.record import Kind, Source, load_record
from monai_fast.telemetry.run_record import RunRecord

VAL_SLEEP_S = 0.25  # per validation item: 4 items -> 1 s per validation, far above this tiny net's training


def _items(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {"image": torch.rand(1, 8, 8, 8, generator=g), "label": (torch.rand(1, 8, 8, 8, generator=g) > 0.5).float()}
        for _ in range(n)
    ]


def _slow(x: torch.Tensor) -> torch.Tensor:
    time.sleep(VAL_SLEEP_S)
    return x


def _engines(record: RecordHandler, val_in_thread: bool = False) -> tuple[SupervisedTrainer, SupervisedEvaluator]:
    """A real MONAI trainer and evaluator on tiny tensors; the evaluator's loader sleeps per item."""
    with record.span("setup"):  # the user's own set-up, timed into the record
        net = torch.nn.Conv3d(1, 1, 3, padding=1)
        train = DataLoader(Dataset(_items(4)), batch_size=2)
        val = DataLoader(Dataset(_items(4), Lambdad(keys="image", func=_slow)), batch_size=1)
        evaluator = SupervisedEvaluator(
            device="cpu", val_data_loader=val, network=copy.deepcopy(net) if val_in_thread else net
        )
        handlers = [] if val_in_thread else [ValidationHandler(validator=evaluator, interval=1)]
        trainer = SupervisedTrainer(
            device="cpu",
            max_epochs=2,
            train_data_loader=train,
            network=net,
            optimizer=torch.optim.SGD(net.parameters(), 0.01),
            loss_function=torch.nn.MSELoss(),
            train_handlers=handlers,
        )
    record.attach(trainer)
    record.attach(evaluator)
    TimeBreakdown().attach(trainer)
    return trainer, evaluator


def test_slow_validation_is_the_largest_share_of_a_wall_clock_that_sums_to_100_percent(tmp_path):
    record = RecordHandler(tmp_path)
    trainer, _ = _engines(record)
    folder = CheckpointFolder({"model": trainer.network, "trainer": trainer}, tmp_path / "ckpt", n_saved=1)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, folder)  # ignite's way: the Checkpoint is the handler
    trainer.run()

    d = doctor(tmp_path)
    wc = d.numbers["wall_clock"]
    assert abs(sum(wc["shares"].values()) - 1.0) <= 0.01, wc
    assert abs(sum(wc["seconds"].values()) - wc["total_s"]) <= 0.01 * wc["total_s"]
    assert max(wc["seconds"], key=wc["seconds"].get) == "validation", wc
    assert wc["seconds"]["validation"] >= 2 * 4 * VAL_SLEEP_S * 0.95
    assert wc["seconds"]["checkpoint"] > 0 and wc["seconds"]["setup"] > 0 and wc["seconds"]["compute"] > 0
    fixes = [f for f in d.fixes if not f.startswith(ATTACH)]  # a plain trainer: FastTraining's one line first
    assert fixes[0].startswith("validation is") and "ValidationHandler(interval=N)" in fixes[0]
    assert sum("validate less often" in f for f in d.fixes) == 1
    assert "where the wall clock went:" in d.text()
    report = (tmp_path / "report.md").read_text()
    assert "## Where the wall clock went" in report and "| validation |" in report and "| **total** |" in report
    assert (tmp_path / "wall_clock.png").stat().st_size > 0
    written = json.loads((tmp_path / "doctor.json").read_text())
    assert written["numbers"]["wall_clock"]["seconds"] == pytest.approx(wc["seconds"])


def test_work_beside_training_is_listed_as_overlapped_and_not_counted_in_the_shares(tmp_path):
    record = RecordHandler(tmp_path)
    trainer, evaluator = _engines(record, val_in_thread=True)
    threads: list[threading.Thread] = []

    def fill_cache() -> None:  # a background cache fill, as the data layer writes it: through the record
        with record.span("cache_fill"):
            time.sleep(0.3)

    def validate_in_background(engine) -> None:  # a snapshot validated beside training
        threads.append(threading.Thread(target=evaluator.run))
        threads[-1].start()

    trainer.add_event_handler(
        Events.STARTED, lambda e: (threads.append(threading.Thread(target=fill_cache)), threads[-1].start())
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=1), validate_in_background)
    # joined within the run: the record closes when the trainer's run ends
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=2), lambda e: [t.join(timeout=60) for t in threads])
    trainer.run()

    wc = wall_clock(load_record(tmp_path)[0])[0]
    assert wc.overlapped["validation"] >= 4 * VAL_SLEEP_S * 0.95
    assert wc.overlapped["cache_fill"] >= 0.3 * 0.95
    assert wc.seconds["validation"] == 0 and wc.seconds["cache_fill"] == 0
    assert sum(wc.seconds.values()) == pytest.approx(wc.total_s)
    doctor(tmp_path)
    assert "Overlapped with training" in (tmp_path / "report.md").read_text()


def test_a_span_of_an_unknown_category_fails_before_its_work_naming_the_categories():
    rec = RunRecord(None)
    ran = []
    with pytest.raises(
        ValueError,
        match=r"span category must be one of .*setup, cache_fill, validation, checkpoint, paused .*got 'compute'",
    ):
        with rec.span("compute"):
            ran.append(1)
    assert ran == [] and rec.rows == []


def test_wall_clock_fix_already_applied_by_fast_training_is_not_recommended():
    rec = RunRecord(None)
    rec.add_span("run", 0.0, 10.0, source=Source.RECORD)
    rec.add_span("validation", 2.0, 8.0, source=Source.RECORD)
    rec.add(Kind.ITERATION, Source.TIME_BREAKDOWN, engine="train", epoch=1, time=2.0, data_s=0.1, compute_s=1.0)
    rec.add(Kind.EPOCH, Source.TIME_BREAKDOWN, engine="train", epoch=1, iterations=1, data_s=0.1, compute_s=1.0)
    rows = [dict(r) for r in rec.rows]
    before = diagnose(rows).fixes
    assert any("FastTraining(precision='auto')" in f and f.startswith("validation is") for f in before)
    rows.append({"kind": "event", "source": "fast_training", "lever": "precision", "applied": True, "setting": "bf16"})
    after = diagnose(rows).fixes
    assert not any("FastTraining(precision='auto')" in f and f.startswith("validation is") for f in after)
    assert any("ValidationHandler(interval=N)" in f for f in after)
    assert set(wall_clock(rows)[0].seconds) == set(SHARES)


def test_recipe_runner_records_its_set_up_in_the_wall_clock(tiny_files, tiny_config, tmp_path):
    cfg = RecipeConfig(**{**tiny_config.to_dict(), "patch_size": (16, 16, 16), "channels": (4, 8), "strides": (2,)})
    r = run_to_target(
        "monai_tutorial", *tiny_files, cfg, target=1.01, time_budget_s=None, run_dir=tmp_path, progress=False
    )
    wc = doctor(r.run_dir).numbers["wall_clock"]
    assert wc["seconds"]["setup"] == pytest.approx(r.setup_s, rel=0.05, abs=0.05)  # data sets and caches built
    assert wc["seconds"]["validation"] > 0 and wc["total_s"] <= r.total_s + 0.1
