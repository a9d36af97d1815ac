import csv
import json
import os

import pytest
from PIL import Image

import monai_fast.apps.demo.core as race_core
from monai_fast.apps.demo import OptionError, RaceEvents, RaceSpec, SyntheticData, bench, race, summarize

TINY = {"patch_size": (32, 32, 32), "num_samples": 2, "num_workers": 1, "cache_threads": 1, "max_epochs": 2}


class _Log(RaceEvents):
    def __init__(self):
        self.seen = []

    def recipe_started(self, recipe, target, time_budget_s):
        self.seen.append(("started", recipe, target, time_budget_s))

    def recipe_finished(self, result):
        self.seen.append(("finished", result.recipe, result.diagnosis is not None))

    def race_finished(self, run):
        self.seen.append(("race", run.results_json.is_file()))


def test_race_with_plain_arguments_returns_diagnosed_results_and_writes_files(tiny_files, tmp_path):
    train, val = tiny_files
    events = _Log()
    run = race(
        RaceSpec(
            recipes=["fast"],
            train_files=train,
            val_files=val,
            target=0.99,
            time_budget_s=120.0,
            device="cpu",
            overrides=TINY,
            run_dir=tmp_path / "run",
            progress=False,
        ),
        events,
    )

    (r,) = run.results
    assert r.recipe == "fast" and r.epochs_run == 2 and len(r.epochs) == 2 and r.target == 0.99
    assert r.diagnosis["verdict"] in {"data-bound", "compute-bound", "gpu-under-filled", "balanced"}
    assert r.diagnosis["evidence"] and r.diagnosis["fixes"]
    assert (tmp_path / "run" / "fast" / "report.md").is_file()
    assert run.device == "cpu" and run.data_root is None and run.tuning is None
    # the events came in order, the doctor before the recipe was reported finished, the files before the end
    assert events.seen == [("started", "fast", 0.99, 120.0), ("finished", "fast", True), ("race", True)]

    doc = json.loads(run.results_json.read_text())
    assert run.results_json == tmp_path / "run" / "results.json"
    assert doc["results"][0]["diagnosis"] == r.diagnosis and doc["machine"]["device"] and doc["data"] is None
    with open(run.epochs_csv) as f:
        assert [int(row["epoch"]) for row in csv.DictReader(f)] == [1, 2]
    with Image.open(run.plot) as im:
        assert im.size[0] > 300


def _no_training(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the race started although an option is bad")

    monkeypatch.setattr(race_core, "load_data", fail)
    monkeypatch.setattr(race_core, "run_to_target", fail)


def test_run_dir_under_a_regular_file_fails_before_any_training(tmp_path, monkeypatch):
    _no_training(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OptionError, match="run_dir: cannot write into") as info:
        race(RaceSpec(recipes=["fast"], device="cpu", run_dir=blocker / "run", progress=False))
    assert info.value.option == "run_dir"
    assert not (tmp_path / "cache").exists()  # no synthetic data was written either


def test_read_only_run_dir_fails_before_any_training(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("running as root: folder permissions are not enforced (the regular-file case covers root)")
    _no_training(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OptionError, match="run_dir") as info:
            race(RaceSpec(recipes=["fast"], device="cpu", run_dir=locked, progress=False))
        assert info.value.option == "run_dir"
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize(
    "fields, option",
    [
        ({"target": 0.0}, "target"),
        ({"target": 1.5}, "target"),
        ({"recipes": ["fast", "turbo"]}, "recipes"),
        ({"recipes": ["fast", "fast"]}, "recipes"),
        ({"recipes": []}, "recipes"),
        ({"time_budget_s": -1.0}, "time_budget_s"),
        ({"overrides": {"batch_size": 0}}, "overrides"),
        ({"overrides": {"learning_rate": 1.0}}, "overrides"),
        ({"val_files": [{"image": "a", "label": "b"}]}, "train_files"),
        ({"synthetic": SyntheticData(cases=0)}, "synthetic.cases"),
        ({"device": "cuda:0"}, "device"),
        ({"epoch_multiple": 0.0, "interleave": True}, "epoch_multiple"),
        ({"epoch_multiple": 2.0}, "epoch_multiple"),  # needs interleave: fast's epochs set the others' budget
        ({"budget_multiple": -1.0, "interleave": True}, "budget_multiple"),
    ],
)
def test_bad_options_are_named_before_anything_runs(fields, option, tmp_path, monkeypatch):
    import torch

    if option == "device" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _no_training(monkeypatch)
    with pytest.raises(OptionError) as info:
        race(RaceSpec(**{"device": "cpu", "run_dir": tmp_path / "run", **fields}))
    assert info.value.option == option and str(info.value).startswith(f"{option}: ")


def test_bench_rejects_zero_repeats_and_an_unwritable_out_dir(tmp_path, monkeypatch):
    _no_training(monkeypatch)
    with pytest.raises(OptionError, match="repeats"):
        bench(RaceSpec(device="cpu", run_dir=tmp_path / "b"), repeats=0, out_dir=tmp_path)
    (tmp_path / "f").write_text("")
    with pytest.raises(OptionError, match="out_dir"):
        bench(RaceSpec(device="cpu", run_dir=tmp_path / "b"), repeats=1, out_dir=tmp_path / "f" / "out")


def test_summarize_medians_and_same_repeat_speedups():
    from monai_fast.apps.training.run import TrainResult

    def result(recipe, ttt):
        return TrainResult(
            recipe=recipe,
            target=0.9,
            reached=ttt is not None,
            time_to_target_s=ttt,
            epochs_to_target=3 if ttt else None,
            epochs_run=3,
            best_dice=0.9,
            setup_s=1.0,
            total_s=ttt or 100.0,
            train_s_per_epoch=2.0,
            val_s_per_epoch=1.0,
            data_wait_share=0.1,
            time_budget_s=100.0,
            budget_exhausted=ttt is None,
            device="cpu",
            amp=False,
        )

    s = summarize(
        [[result("baseline", 40.0), result("fast", 10.0)], [result("baseline", None), result("fast", 20.0)]],
        ["baseline", "fast"],
    )
    assert s["baseline"]["reached"] == "1/2" and s["baseline"]["median_time_to_target_s"] == 40.0
    assert s["fast"]["median_time_to_target_s"] == 15.0
    assert s["fast"]["speedup_over_baseline"] == [
        {"factor": 4.0, "lower_bound": False},
        {"factor": 5.0, "lower_bound": True},
    ]
    assert "speedup_over_monai_tutorial" not in s["fast"]
