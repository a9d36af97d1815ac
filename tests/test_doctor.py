import time

import pytest
import torch
from ignite.engine import Engine

from monai_fast.apps.cli import main
from monai_fast.apps.recipes import RecipeConfig, build_recipe
from monai_fast.handlers import GPUSampler, RecordHandler, ThroughputMonitor, TimeBreakdown
from monai_fast.report.doctor import diagnose, doctor
from monai_fast.telemetry.nvml import FakeNvml


def _record_recipe(run_dir, name, files, config, gpu=None):
    r = build_recipe(name, *files, config, progress=False)
    RecordHandler(run_dir).attach(r.trainer)
    TimeBreakdown().attach(r.trainer)
    ThroughputMonitor(log_every_epoch=False).attach(r.trainer)
    if gpu is not None:
        GPUSampler(interval_s=0.02, backend=gpu).attach(r.trainer)
    r.trainer.run()
    return run_dir


def test_data_bound_run_of_real_baseline(tmp_path, tiny_files):
    # deliberately data-bound: loading + resampling in the main process, a tiny network on tiny crops
    cfg = RecipeConfig(
        patch_size=(16, 16, 16),
        channels=(2, 4),
        strides=(2,),
        num_res_units=0,
        num_samples=1,
        batch_size=2,
        num_workers=0,
        max_epochs=2,
    )
    d = doctor(_record_recipe(tmp_path, "baseline", tiny_files, cfg))
    assert d.verdict == "data-bound", d.text()
    assert d.numbers["data_share"] >= 0.2
    assert any("FastTraining(cache='auto')" in f for f in d.fixes)
    report = (tmp_path / "report.md").read_text()
    assert "data-bound" in report and "time_breakdown.png" in report and (tmp_path / "time_breakdown.png").is_file()


def test_compute_bound_run_of_real_cached_recipe(tmp_path, tiny_files, tiny_config):
    # deliberately compute-bound: cached data, and a network heavy for these crops (4 epochs, and
    # 64-128-256 channels: with 32-64-128 a slow spell of the shared host once tipped the share to 5.7 %)
    cfg = RecipeConfig(
        **{**tiny_config.to_dict(), "max_epochs": 4, "channels": (64, 128, 256), "strides": (2, 2), "num_res_units": 2}
    )
    d = doctor(_record_recipe(tmp_path, "monai_tutorial", tiny_files, cfg))
    assert d.verdict == "compute-bound", d.text()
    assert d.numbers["data_share"] < 0.05
    assert "CPU" in d.fixes[0]


def test_gpu_under_filled_from_a_fake_gpu_record(tmp_path):
    engine = Engine(lambda e, b: time.sleep(0.01))
    RecordHandler(tmp_path).attach(engine)
    TimeBreakdown().attach(engine)
    GPUSampler(interval_s=0.01, backend=FakeNvml(util=[20.0, 30.0], mem_total_mib=80000)).attach(engine)
    engine.run(list(range(20)), max_epochs=1)
    d = doctor(tmp_path)
    assert d.verdict == "gpu-under-filled", d.text()
    assert (tmp_path / "gpu_util.png").is_file()


def test_balanced_and_missing_breakdown():
    rows = [
        {
            "kind": "epoch",
            "source": "time_breakdown",
            "epoch": 1,
            "iterations": 4,
            "data_s": 1.0,
            "compute_s": 9.0,
            "data_share": 0.1,
        }
    ]
    assert diagnose(rows).verdict == "balanced"
    with pytest.raises(ValueError, match="TimeBreakdown"):
        diagnose([{"kind": "interval", "source": "gpu"}])


def test_doctor_cli(tmp_path, capsys):
    engine = Engine(lambda e, b: None)
    RecordHandler(tmp_path).attach(engine)
    TimeBreakdown().attach(engine)

    def slow():
        for i in range(4):
            time.sleep(0.02)
            yield i

    engine.run(slow(), max_epochs=1, epoch_length=4)
    assert main(["doctor", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "verdict: data-bound" in out and "report.md" in out
    with pytest.raises(SystemExit, match="nothing: no such folder"):
        main(["doctor", str(tmp_path / "nothing")])


def _rank_run(run_dir, rank, step_s, epochs=2):
    engine = Engine(lambda e, b: time.sleep(step_s))
    RecordHandler(run_dir, rank=rank).attach(engine)
    TimeBreakdown().attach(engine)
    ThroughputMonitor(log_every_epoch=False).attach(engine)
    engine.run([{"image": torch.zeros(2, 1, 4, 4, 4)}] * 3, max_epochs=epochs)


def test_doctor_counts_epochs_once_and_names_the_straggler_rank(tmp_path):
    _rank_run(tmp_path, 0, 0.01)
    # a straggler ten times slower: its 6 steps sleep 0.6 s, so the ratio stays over 2 unless rank 0's 6 steps of
    # 10 ms take over 0.3 s (three times slower, 0.18 s against 0.06 s, a 30 ms stall of rank 0 put it under 2)
    _rank_run(tmp_path, 1, 0.1)
    d = doctor(tmp_path)
    assert d.numbers["epochs"] == 2 and d.numbers["ranks"] == 2
    assert d.numbers["slowest_rank"] == 1 and d.numbers["fastest_rank"] == 0
    assert d.numbers["straggler_ratio"] > 2.0
    assert any("slowest rank 1" in e and "straggler" in e for e in d.evidence), d.evidence
    assert "over 2 epoch(s) and 2 ranks" in d.evidence[0]
    report = (tmp_path / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| 0 |")]
    assert [tuple(c.strip() for c in line.split("|")[2:4]) for line in table] == [
        ("1", "0"),
        ("1", "1"),
        ("2", "0"),
        ("2", "1"),
    ]
    assert "What the handlers measured" in report and "rank1: throughput" in report


def test_doctor_on_damaged_records_names_the_file_and_still_gives_a_verdict(tmp_path, caplog):
    _rank_run(tmp_path, 0, 0.0, epochs=1)
    (tmp_path / "summary.rank0.json").write_text("{ not json")
    with caplog.at_level("WARNING"):
        d = doctor(tmp_path)
    assert "summary.rank0.json" in caplog.text and d.verdict
    with open(tmp_path / "record.rank0.jsonl", "a") as f:
        f.write("[1, 2]\n")
    with pytest.raises(ValueError, match=r"record\.rank0\.jsonl:\d+ is not a record row"):
        doctor(tmp_path)


def test_doctor_gives_the_verdict_when_the_report_cannot_be_written(tmp_path, monkeypatch, caplog):
    _rank_run(tmp_path, 0, 0.0, epochs=1)
    (tmp_path / "report.md").mkdir()  # a folder where the report should go: the write fails, also as root
    with caplog.at_level("WARNING"):
        d = doctor(tmp_path)
    assert d.verdict and d.report is None
    assert "could not write the report" in caplog.text
