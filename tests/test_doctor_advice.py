"""The doctor's advice fits the evidence: real MONAI engines write real records, the doctor reads them.

A plain trainer gets the one line that applies the levers its record shows unused; validation and
sliding-window advice come only with the measured share and window count behind them; a run stopped by
Ctrl-C is said to be interrupted; a folder written by two runs is read as the last one; the lock file
goes with a clean exit; the CLI tells a missing folder from one without a record and stops quietly when
its reader closes the pipe.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.handlers import MeanDice, ValidationHandler, from_engine
from monai.inferers import SimpleInferer, SlidingWindowInferer
from monai.networks.nets import UNet
from monai.transforms import AsDiscreted

from monai_fast.apps.cli import main
from monai_fast.apps.recipes import RecipeConfig
from monai_fast.handlers import InferenceSplit, RecordHandler, ThroughputMonitor, TimeBreakdown
from monai_fast.report.doctor import doctor, prescribe
from monai_fast.telemetry.precision import cpu_has_bf16_hardware
from monai_fast.telemetry.record import load_record
from tests.test_doctor import _record_recipe

REPO = Path(__file__).resolve().parents[1]


def _items(n: int, size: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "image": torch.rand(1, size, size, size, generator=g),
            "label": (torch.rand(1, size, size, size) > 0.5).float(),
        }
        for _ in range(n)
    ]


def _engines(
    run_dir: Path,
    val_items: int,
    roi: int,
    val_size: int = 16,
    epochs: int = 2,
    record: bool = True,
    train_items: int = 2,
    step_sleep_s: float = 0.0,
):
    """A plain MONAI trainer (fp32, a list of tensors: no cache) and its sliding-window evaluator, recorded."""
    torch.manual_seed(0)
    net = UNet(3, 1, 1, channels=(2, 4), strides=(2,), num_res_units=0)
    loader = torch.utils.data.DataLoader(_items(train_items, 16), batch_size=2)
    val_loader = torch.utils.data.DataLoader(_items(val_items, val_size), batch_size=1)
    post = [AsDiscreted(keys="pred", threshold=0.5)]
    evaluator = SupervisedEvaluator(
        "cpu",
        val_loader,
        net,
        inferer=SlidingWindowInferer(roi_size=(roi,) * 3, sw_batch_size=1),
        postprocessing=post[0],
        key_val_metric={"dice": MeanDice(include_background=True, output_transform=from_engine(["pred", "label"]))},
    )
    trainer = SupervisedTrainer(
        "cpu",
        epochs,
        loader,
        net,
        torch.optim.SGD(net.parameters(), lr=0.01),
        _slow_loss(step_sleep_s),
        inferer=SimpleInferer(),
        train_handlers=[ValidationHandler(1, evaluator)],
    )
    if record:
        handler = RecordHandler(run_dir)
        handler.attach(trainer)
        handler.attach(evaluator)
        InferenceSplit().attach(evaluator)
    TimeBreakdown().attach(trainer)
    return trainer, evaluator


def _slow_loss(sleep_s: float):
    """BCE whose every training step also takes ``sleep_s``: a wall-clock share no busy host can turn over."""
    bce = torch.nn.BCEWithLogitsLoss()
    if not sleep_s:
        return bce

    def loss(pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        time.sleep(sleep_s)
        return bce(pred, label)

    return loss


def test_a_plain_trainer_gets_the_one_line_that_applies_the_levers_its_record_shows_unused(tmp_path, tiny_files):
    cfg = RecipeConfig(
        patch_size=(16, 16, 16),
        channels=(2, 4),
        strides=(2,),
        num_res_units=0,
        num_samples=1,
        batch_size=2,
        num_workers=0,
        max_epochs=2,
        precision="fp32",
    )
    d = doctor(_record_recipe(tmp_path, "baseline", tiny_files, cfg))
    first = d.fixes[0]
    assert first.startswith("FastTraining().attach(trainer, evaluator) applies the levers this run left unused"), (
        d.fixes
    )
    assert "data (the training data set is not a cache" in first
    assert ("precision (the trainer ran in fp32 on a CPU with bf16 instructions)" in first) == cpu_has_bf16_hardware()
    assert not any("KernelProfiler" in f for f in d.fixes)
    # a FastTraining option is not a code change that no FastTraining option makes
    lines = prescribe(load_record(tmp_path)[0], d).splitlines()
    assert lines[0] == "FastTraining().attach(trainer, evaluator)"
    if "# code changes" in "\n".join(lines):
        code = lines[next(i for i, ln in enumerate(lines) if ln.startswith("# code changes")) :]
        assert not any("FastTraining(" in ln for ln in code), lines
    assert any("FastTraining(cache='disk'" in ln for ln in lines) == (d.verdict == "data-bound")


def test_sliding_window_and_validation_advice_follow_the_measured_windows_and_share(tmp_path):
    # validation is most of the wall clock here; each volume is exactly one window, then several
    one, _ = _engines(tmp_path / "one", val_items=12, roi=16)
    one.run()
    d = doctor(tmp_path / "one")
    assert d.numbers["in_effect"]["windows_per_volume"] == 1
    validation = next(f for f in d.fixes if f.startswith("validation is "))
    assert "sw_batch_size" not in " ".join(d.fixes) and "validate less often" in validation
    eight, _ = _engines(tmp_path / "eight", val_items=12, roi=8)
    eight.run()
    d = doctor(tmp_path / "eight")
    assert d.numbers["in_effect"]["windows_per_volume"] > 1
    assert any("sw_batch_size" in f for f in d.fixes)
    # validation a small share of the wall clock: no advice to validate less
    few, _ = _engines(tmp_path / "few", val_items=1, roi=16, val_size=8, epochs=3, train_items=16, step_sleep_s=0.05)
    few.run()
    d = doctor(tmp_path / "few")
    assert d.numbers["wall_clock"]["shares"]["validation"] < 0.3
    assert not any("validate less often" in f or "sw_batch_size" in f for f in d.fixes), d.fixes


def test_a_run_stopped_by_ctrl_c_is_said_to_be_interrupted(tmp_path):
    trainer, _ = _engines(tmp_path, val_items=1, roi=16, epochs=4)
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=2), lambda e: signal.raise_signal(signal.SIGINT))
    # a suite started in the background (nohup, &) inherits SIGINT ignored: Ctrl-C's handler, as a terminal has it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    d = doctor(tmp_path)
    assert d.numbers["raised"] == "KeyboardInterrupt"
    assert any(e.startswith("the run was interrupted (Ctrl-C) at epoch 2") for e in d.evidence), d.evidence
    text = d.text()
    assert "to its interruption (Ctrl-C)" in text and "to the end of training" not in text


def test_a_folder_written_by_a_second_run_is_read_as_that_run_and_the_lock_goes_with_a_clean_exit(tmp_path):
    first, _ = _engines(tmp_path, val_items=1, roi=16, epochs=2)
    first.run()
    assert not list(tmp_path.glob(".monai-fast*.lock"))  # no lock file naming a process that has ended
    second, _ = _engines(tmp_path, val_items=1, roi=16, epochs=3)  # a notebook's attach cell run again
    second.run()
    d = doctor(tmp_path)
    assert d.numbers["epochs"] == 3  # the second run's, not 2 + 3
    assert any("holds 1 earlier run(s)" in e for e in d.evidence), d.evidence
    report = (tmp_path / "report.md").read_text()
    table = [ln for ln in report.splitlines() if re.match(r"\| \d+ \| \d+ \| ", ln)]  # the per-epoch table
    assert [ln.split(" | ")[1] for ln in table] == ["1", "2", "3"] and all(ln.startswith("| 1 |") for ln in table)
    assert not list(tmp_path.glob(".monai-fast*.lock"))


def test_the_eta_line_counts_the_validation_of_the_epoch_it_follows(tmp_path, caplog):
    trainer, evaluator = _engines(tmp_path, val_items=1, roi=16, epochs=3, record=False)
    evaluator.add_event_handler(Events.COMPLETED, lambda e: time.sleep(0.4))  # validation's cost, every epoch
    ThroughputMonitor().attach(trainer)
    with caplog.at_level("INFO", logger="monai_fast.handlers"):
        trainer.run()
    lines = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert len(lines) == 3, lines
    first = re.search(r"ETA (\d+) s \((\d+) s of it epoch-end work\)", lines[0])
    assert first is not None and int(first.group(2)) >= 1, lines[0]  # 2 epochs left x >= 0.4 s each
    assert all(float(re.search(r"([\d.]+) s of epoch-end work", ln).group(1)) >= 0.4 for ln in lines), lines


def test_the_doctor_cli_tells_a_missing_folder_from_one_without_a_record(tmp_path):
    with pytest.raises(SystemExit, match=r"nothing: no such folder$"):
        main(["doctor", str(tmp_path / "nothing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        SystemExit, match=r"no monai-fast record .* FastTraining\(\)\.attach\(trainer, evaluator\) alone"
    ):
        main(["doctor", str(tmp_path / "empty")])
    # a race's folder: a record per recipe, one level down
    trainer, _ = _engines(tmp_path / "race" / "fast", val_items=1, roi=16, epochs=1)
    trainer.run()
    with pytest.raises(
        SystemExit, match=r"race holds no record itself; its runs' records are in fast: monai-fast doctor"
    ):
        main(["doctor", str(tmp_path / "race")])


def test_doctor_piped_into_a_reader_that_stops_early_exits_quietly(tmp_path):
    trainer, _ = _engines(tmp_path, val_items=1, roi=16, epochs=2)
    trainer.run()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "monai_fast", "doctor", str(tmp_path), "--apply"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=env,
    )
    proc.stdout.close()  # `| head -0`: the reader is gone before the doctor writes
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 1
