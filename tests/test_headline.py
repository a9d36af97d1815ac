"""The demo's headline: interleaved epochs, each recipe on its own random stream, a budget derived from fast's
epochs (or time), figures marked measured or estimated."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from monai_fast.apps.cli import main
from monai_fast.apps.demo import RaceSpec, SyntheticData, race
from monai_fast.apps.demo.core import load_data
from monai_fast.apps.demo.headline import (
    ESTIMATED,
    MEASURED,
    MIN_PROGRESS,
    epochs_by_progress,
    epochs_by_slope,
    format_headline,
    headline,
)
from monai_fast.apps.demo.interleave import budget_after_lead, epochs_after_lead
from monai_fast.apps.training.options import recipe_config
from monai_fast.apps.training.run import EpochRow, TargetRun, TrainResult
from monai_fast.telemetry.host import describe_host_load

TINY_RACE = {"max_epochs": 6, "patch_size": (32, 32, 32), "channels": (4, 8), "strides": (2,), "precision": "fp32"}
TINY_DEMO = [
    "--cases",
    "4",
    "--shape",
    "32",
    "32",
    "32",
    "--patch-size",
    "32",
    "32",
    "32",
    "--channels",
    "4",
    "8",
    "--precision=fp32",
    "--no-progress",
]


def _result(
    recipe: str,
    dice: list[float],
    target: float,
    s_per_epoch: float,
    reached_at: int | None = None,
    cpu_s_per_epoch: float | None = None,
    setup_cpu_s: float | None = None,
    device: str = "CPU x86_64",
    crops: int | None = None,
) -> TrainResult:
    rows = [
        EpochRow(
            recipe,
            i + 1,
            (i + 1) * s_per_epoch,
            s_per_epoch * 0.8,
            s_per_epoch * 0.2,
            0.0,
            1.0,
            0.0,
            1.0,
            d,
            cpu_s=cpu_s_per_epoch,
            train_samples=crops,
            val_volumes=None if crops is None else 2,
        )
        for i, d in enumerate(dice)
    ]
    reached = reached_at is not None
    return TrainResult(
        recipe,
        target,
        reached,
        reached_at * s_per_epoch if reached else None,
        reached_at,
        len(rows),
        max(dice),
        0.0,
        len(rows) * s_per_epoch,
        s_per_epoch * 0.8,
        s_per_epoch * 0.2,
        0.1,
        100.0,
        not reached,
        device,
        False,
        epochs=rows,
        setup_cpu_s=setup_cpu_s,
    )


def test_baseline_stopped_early_gets_an_estimate_from_its_dice_curve_labelled_estimated():
    fast = _result("fast", [0.3, 0.6, 0.9], 0.9, 1.0, reached_at=3)
    base = _result("baseline", [0.1, 0.2, 0.3, 0.4], 0.9, 4.0)  # 0.4 at epoch 4; fast had 0.6 at epoch 2
    doc = headline([fast, base], {"fast": 3, "baseline": 1}, {"time_budget_s": 300})
    b = doc["recipes"]["baseline"]
    assert (
        b["epochs_to_target"]["how"] == ESTIMATED and "reached Dice 0.400 at epoch 4" in b["epochs_to_target"]["basis"]
    )
    assert (
        b["epochs_to_target"]["value"] == 4 * 3 / 2
    )  # its epoch at 0.4 x fast's epochs to target / fast's epoch at 0.4
    # its time: epochs x its seconds per epoch measured interleaved (its first epoch only here)
    assert b["time_to_target_s"]["value"] == pytest.approx(b["epochs_to_target"]["value"] * 4.0)
    assert doc["recipes"]["fast"]["time_to_target_s"] == {"value": 3.0, "how": MEASURED, "basis": ""}
    assert doc["speedup"]["how"] == ESTIMATED and doc["speedup"]["factor"] == pytest.approx(
        b["time_to_target_s"]["value"] / 3.0
    )
    table = format_headline(doc)
    assert "(estimated)" in table.splitlines()[3] and "(measured)" in table.splitlines()[2]
    assert "speed-up over baseline:" in table and "(estimated:" in table and ">=" not in table


def test_a_baseline_still_at_the_flat_start_of_its_curve_gets_no_estimate_and_the_headline_is_for_equal_work():
    fast = _result("fast", [0.2, 0.4, 0.6, 0.9], 0.9, 1.0, reached_at=4, crops=4)
    # below MIN_PROGRESS x target: extrapolating is noise; its epochs hold twice fast's crops
    base = _result("baseline", [0.04, 0.05, 0.048] * 3, 0.9, 3.0, crops=8)
    assert epochs_by_progress([(i + 1, d.val_dice) for i, d in enumerate(base.epochs)], [(1, 0.2)], 4, 0.9) is None
    doc = headline([fast, base], {"fast": 4, "baseline": 4}, {})
    b = doc["recipes"]["baseline"]
    assert b["epochs_to_target"]["value"] is None and b["time_to_target_s"]["how"] == "n/a"
    assert f"below {MIN_PROGRESS:g}x the target" in b["time_to_target_s"]["basis"]
    # per crop: 3.0 x 0.8 s / 8 against 1.0 x 0.8 s / 4; per validated volume: 3.0 x 0.2 s / 2 against 1.0 x 0.2 s / 2
    sp = doc["speedup"]
    assert sp["factor"] is None and "per_epoch" not in sp
    assert sp["per_crop"] == pytest.approx(1.5) and sp["per_volume"] == pytest.approx(3.0)
    table = format_headline(doc)
    assert (
        "speed-up over baseline for equal work: training per crop 1.5x, validation per volume 3.0x "
        "(measured, interleaved); to the target: n/a"
    ) in table
    assert "an epoch held: fast 4 training crops" in table and "baseline 8 training crops" in table
    assert "e+" not in table  # no absurd extrapolated figure


def test_baseline_reaching_the_target_is_measured():
    fast = _result("fast", [0.5, 0.9], 0.9, 1.0, reached_at=2)
    base = _result("baseline", [0.3, 0.6, 0.9], 0.9, 3.0, reached_at=3)
    sp = headline([fast, base], {"fast": 2, "baseline": 1}, {})["speedup"]
    assert {k: sp[k] for k in ("over", "factor", "how", "basis", "clock")} == {
        "over": "baseline",
        "factor": pytest.approx(9.0 / 2.0),
        "how": MEASURED,
        "basis": "baseline's time to target (measured) / fast's (measured)",
        "clock": "wall",
    }
    assert sp["cpu_factor"] is None  # no CPU times recorded: none made up


QUIET = {"others_cpu_share": 0.01, "cpus": 2, "wall_s": 60.0}
BUSY = {"others_cpu_share": 0.5, "cpus": 2, "wall_s": 60.0}


def _busy_pair(device: str = "CPU x86_64") -> tuple[TrainResult, TrainResult]:
    """A race on a loaded host: fast 2 s/epoch on the wall for 1 CPU s; baseline 5 s for 4 CPU s (it runs more
    threads)."""
    fast = _result("fast", [0.5, 0.9], 0.9, 2.0, reached_at=2, cpu_s_per_epoch=1.0, setup_cpu_s=2.0, device=device)
    base = _result("baseline", [0.2, 0.3, 0.45, 0.6], 0.9, 5.0, cpu_s_per_epoch=4.0, setup_cpu_s=0.0, device=device)
    return fast, base


def test_the_speedup_is_the_wall_clocks_on_a_busy_host_too_with_the_cpu_seconds_beside():
    fast, base = _busy_pair()
    doc = headline([fast, base], {"fast": 2, "baseline": 2}, {}, host=BUSY)
    b = doc["recipes"]["baseline"]
    assert doc["recipes"]["fast"]["cpu_s_to_target"] == {"value": 2.0 + 2 * 1.0, "how": MEASURED, "basis": ""}
    epochs = b["epochs_to_target"]["value"]  # 0.6 at its epoch 4, fast had it at 2 and the target at 2: 4 x 2 / 2
    assert epochs == 4 * 2 / 2 + 0 or epochs > 4  # raised past the epochs it ran when the estimate falls within them
    assert b["cpu_s_to_target"]["how"] == ESTIMATED and b["cpu_s_to_target"]["value"] == pytest.approx(epochs * 4.0)
    sp = doc["speedup"]
    assert sp["clock"] == "wall" and sp["factor"] == pytest.approx(epochs * 5.0 / 4.0)  # the wall clock's, busy or not
    assert sp["cpu_factor"] == pytest.approx(epochs * 4.0 / 4.0) and sp["cpu_how"] == ESTIMATED  # beside it
    table = format_headline(doc)
    assert "CPU s to target" in table.splitlines()[0]
    assert f"speed-up over baseline: {sp['factor']:.1f}x (estimated:" in table
    assert f"; in CPU time {sp['cpu_factor']:.1f}x" in table
    assert describe_host_load(BUSY, "the epochs taken in turns") in table and "a busy host" in table
    quiet = headline([fast, base], {"fast": 2, "baseline": 2}, {}, host=QUIET)["speedup"]
    assert quiet == sp  # the host's load changes the line under the table, not how the speed-up is taken
    gpu = headline(list(_busy_pair("CUDA NVIDIA H100")), {"fast": 2, "baseline": 2}, {}, host=BUSY)["speedup"]
    assert gpu["clock"] == "wall" and gpu["factor"] == sp["factor"]


def test_budget_is_a_multiple_of_the_leads_time_within_the_cap():
    assert budget_after_lead(10.0, multiple=3.0, cap=300.0) == 30.0
    assert budget_after_lead(200.0, multiple=3.0, cap=300.0) == 300.0
    assert budget_after_lead(7.0, multiple=2.0, cap=None) == 14.0


def test_interleaved_race_gives_the_baseline_a_budget_derived_from_fasts_time(tmp_path):
    spec = RaceSpec(
        recipes=("fast", "baseline"),
        synthetic=SyntheticData(cases=4, shape=(32, 32, 32)),
        target=0.015,
        time_budget_s=300,
        budget_multiple=1.0,
        interleave=True,
        device="cpu",
        run_dir=tmp_path / "run",
        progress=False,
        preflight=False,
        overrides=TINY_RACE,
    )
    run = race(spec)
    fast, base = run.results
    assert fast.reached  # Dice 0.012 then 0.020 at this size and seed
    budget = run.meta["headline"]["budget"]
    assert budget["lead_s"] == pytest.approx(fast.time_to_target_s) and budget["lead_reached"]
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    if base.time_budget_s == 300:
        # the turns are taken by clock: a busy host can give the baseline all its epochs (or this tiny target) in
        # its turns before fast reaches the target; then it is done there and no budget is derived for it
        assert base.epochs_run == doc["headline"]["recipes"]["baseline"]["epochs_interleaved"]
        assert doc["headline"]["recipes"]["baseline"]["stopped"] in ("target", "epoch limit")
        return
    assert base.time_budget_s == pytest.approx(fast.time_to_target_s) == pytest.approx(budget["others_s"])
    assert base.time_budget_s < 300 and not base.reached
    assert doc["headline"]["recipes"]["baseline"]["stopped"] == "wall-clock budget"
    est = doc["headline"]["recipes"]["baseline"]["time_to_target_s"]
    if (
        est["how"] == ESTIMATED
    ):  # the epochs its budget gave it (time-bound: one or two here) made a curve to extrapolate
        assert est["value"] > 0 and "measured interleaved" in est["basis"]
    else:  # too few: no estimate, said why, and the headline is the speed-up for equal work, measured
        assert est["how"] == "n/a" and "too early in its curve" in est["basis"]
        per_crop = doc["headline"]["speedup"]["per_crop"]
        crops = doc["headline"]["recipes"]["baseline"]["epoch_holds"]["train_crops_per_epoch"]
        # a busy host can end the baseline's budget (fast's time to target) before it trained a whole epoch
        assert per_crop > 0 if crops else per_crop is None, (base.epochs_run, crops, per_crop)
    assert doc["headline"]["recipes"]["fast"]["epochs_interleaved"] == fast.epochs_run


def test_demo_prints_the_cap_up_front_and_a_table_of_measured_and_estimated_figures(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MONAI_FAST_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert (
        main(
            [
                "demo",
                *TINY_DEMO,
                "--seed",
                "1",  # a split whose validation case the baseline's first epochs stay below the target on
                "--max-epochs",
                "6",
                "--target",
                "0.015",
                "--time-budget",
                "250",
                "--epoch-multiple",
                "1.5",
                "--run-dir",
                str(run),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(
        "sized for cpu (default: small, for a CPU): 4 synthetic volumes of 32x32x32 voxels, "
        "32x32x32 patches, UNet 4-8 with 1 residual unit(s)"
    )
    assert out.splitlines()[1].startswith(
        "budget: fast up to 250 s; baseline 1.5x fast's epochs to target, at most 250 s"
    )
    doc = json.loads((run / "results.json").read_text())
    k = doc["headline"]["budget"]["lead_epochs"]
    assert f"-- baseline: budget {epochs_after_lead(k, 1.5)} epochs (fast reached the target in {k} epochs" in out
    head = next(ln for ln in out.splitlines() if ln.startswith("recipe"))
    assert (
        re.split(r"\s{2,}", head)[:2] == ["recipe", "time to target s"]
        and "epochs to target" in head
        and "s/epoch interleaved" in head
    )
    lines = out.splitlines()
    at = lines.index(head)
    rows = {ln.split()[0]: ln for ln in lines[at + 2 : at + 4]}  # under the header and its rule
    assert rows["fast"].count("(measured)") == 4  # time, CPU time and epochs to target, s/epoch
    if rows["baseline"].count("(estimated)") == 3:
        assert "baseline time to target: estimated:" in out and "speed-up over baseline:" in out
    else:  # a curve too flat to extrapolate (the tiny baseline's, often): no figure, the reason, the per-epoch headline
        assert rows["baseline"].split()[1:4] == ["-", "-", "-"] and "baseline time to target: n/a: its best Dice" in out
        assert re.search(
            r"for equal work: training per crop [\d.]+x.*\(measured, interleaved\); to the target: n/a", out
        )
    assert set(doc["headline"]) == {"method", "budget", "recipes", "speedup", "host"}
    host = doc["headline"]["host"]
    assert 0 <= host["others_cpu_share"] <= 1 and host["cpus"] >= 1 and host["wall_s"] > 0
    assert describe_host_load(host, "the epochs taken in turns") in out  # the line under the table
    assert set(doc["headline"]["recipes"]["baseline"]) >= {
        "time_to_target_s",
        "epochs_to_target",
        "s_per_epoch_interleaved",
        "epochs_interleaved",
        "epochs_run",
        "best_dice",
    }


def test_a_recipe_trains_the_same_alone_as_in_turns_with_another():
    # its own random stream: the baseline's draws between fast's turns (shuffles, workers' seeds) change none of fast's
    _, train, val = load_data(RaceSpec(synthetic=SyntheticData(cases=6, shape=(32, 32, 32)), progress=False))
    config = recipe_config(TINY_RACE, seed=0)

    def fast_losses(beside: str | None) -> list[float]:
        runs = [TargetRun(name, train, val, config, "cpu", 0.99, 300, None, False) for name in ("fast", beside) if name]
        for _ in range(3):
            for run in runs:
                run.segment(epochs=1)
        return [row.loss for row in runs[0].recorder.rows]

    alone = fast_losses(None)
    assert len(alone) == 3 and fast_losses("baseline") == alone


def test_the_baselines_epoch_budget_and_its_curve_do_not_depend_on_the_order_of_the_turns(tmp_path, monkeypatch):
    spec = RaceSpec(
        recipes=("fast", "baseline"),
        synthetic=SyntheticData(cases=4, shape=(32, 32, 32)),
        seed=1,  # a split whose validation case the baseline stays below the target on, and fast takes epochs to reach
        target=0.1,
        time_budget_s=300,
        epoch_multiple=2.0,
        interleave=True,
        device="cpu",
        run_dir=tmp_path / "quiet",
        progress=False,
        preflight=False,
        overrides={**TINY_RACE, "max_epochs": 12},
    )
    quiet = race(spec)
    real = TargetRun.elapsed  # a host where fast's epochs take 5x as long: the baseline takes more turns in a row
    monkeypatch.setattr(TargetRun, "elapsed", lambda run: real(run) * (5.0 if run.recipe == "fast" else 1.0))
    loaded = race(replace(spec, run_dir=tmp_path / "loaded"))
    docs = [run.meta["headline"] for run in (quiet, loaded)]
    assert docs[0]["recipes"]["baseline"]["epochs_interleaved"] < docs[1]["recipes"]["baseline"]["epochs_interleaved"]
    for run, doc in zip((quiet, loaded), docs):
        fast, base = run.results
        assert fast.reached and doc["budget"]["lead_epochs"] == fast.epochs_to_target
        assert doc["budget"]["others_epochs"] == 2 * fast.epochs_to_target
        # turns taken while fast trained may carry it past its budget; its estimate reads only the budget's epochs
        assert base.reached or (
            base.epochs_run >= doc["budget"]["others_epochs"]
            and doc["recipes"]["baseline"]["stopped"] == "epoch budget"
        )
    for a, b in zip(quiet.results, loaded.results):  # the same Dice, epoch by epoch, for both recipes
        n = min(len(a.epochs), len(b.epochs))
        assert n >= (2 if a.recipe == "fast" else 4) and [e.val_dice for e in a.epochs[:n]] == [
            e.val_dice for e in b.epochs[:n]
        ]
    assert docs[0]["recipes"]["baseline"]["epochs_to_target"] == docs[1]["recipes"]["baseline"]["epochs_to_target"]


def test_a_wall_clock_cap_cutting_the_epoch_budget_short_is_said():
    fast = _result("fast", [0.3, 0.6, 0.9], 0.9, 1.0, reached_at=3)
    base = _result("baseline", [0.1, 0.2, 0.3, 0.4], 0.9, 4.0)  # its 16 s budget spent after 4 of its 6 epochs
    budget = {"lead": "fast", "time_budget_s": 16.0, "epoch_multiple": 2.0, "lead_epochs": 3, "others_epochs": 6}
    doc = headline([fast, replace(base, time_budget_s=16.0, budget_exhausted=True)], {"fast": 3, "baseline": 1}, budget)
    assert (
        doc["recipes"]["baseline"]["stopped"] == "wall-clock budget" and doc["recipes"]["fast"]["stopped"] == "target"
    )
    assert (
        "baseline: stopped by its wall-clock budget after 4 of its 6 epochs: how far its Dice curve got depended on "
        "the host's speed"
    ) in format_headline(doc)
    assert headline([fast, replace(base, epochs_run=6)], {}, budget)["recipes"]["baseline"]["stopped"] == "epoch budget"


def test_a_lead_that_finished_no_epoch_sets_no_epoch_budget_and_the_bound_is_named():
    # fast's share of the total bound ran out inside its first epoch: 100x "no epoch" is not one epoch
    from monai_fast.apps.cli.race_cmds import budget_text

    assert epochs_after_lead(0, 100.0) is None and epochs_after_lead(1, 100.0) == 100
    how = {
        "lead": "fast",
        "lead_s": 10.0,
        "lead_reached": False,
        "lead_epochs": 0,
        "multiple": None,
        "time_budget_s": None,
        "epoch_multiple": 100.0,
        "others_epochs": None,
        "total_budget_left_s": 19.0,
    }
    assert "no epoch budget without one of its epochs" in budget_text(19.0, how)
    fast = replace(_result("fast", [0.0], 0.99, 1.0), epochs=[], epochs_run=0, best_dice=0.0)
    base = _result("baseline", [0.1, 0.2, 0.3], 0.99, 4.0)
    budget = {"lead": "fast", "others_epochs": None, "bound_stopped": ["fast", "baseline"]}
    doc = headline([fast, base], {"fast": 0, "baseline": 1}, budget)
    assert doc["recipes"]["baseline"]["stopped"] == "total time bound"
    assert "baseline: stopped by the total time bound after 3 epochs: how far" in format_headline(doc)


def test_where_fasts_validations_are_too_sparse_the_baselines_own_slope_is_extrapolated():
    # fast validated fully only at its target epoch: "fast reached Dice 0.3 at epoch 9" would make 30 x 9 / 9,
    # no more than the baseline ran (a bare lower bound); the line through its last half reaches 0.9 at epoch 90
    fast = _result("fast", [0.0] * 8 + [0.94], 0.9, 1.0, reached_at=9)
    base = _result("baseline", [0.01 * e for e in range(1, 31)], 0.9, 4.0)
    assert epochs_by_slope([(i + 1, r.val_dice) for i, r in enumerate(base.epochs)], 0.9) == (90.0, 16, 30, 0.01)
    b = headline([fast, base], {"fast": 9, "baseline": 1}, {"lead": "fast"})["recipes"]["baseline"]
    assert b["epochs_to_target"]["value"] == 90.0 and b["epochs_to_target"]["how"] == ESTIMATED
    assert "per epoch over epochs 16-30 (least squares" in b["epochs_to_target"]["basis"]
    assert "raised" not in b["epochs_to_target"]["basis"]
    assert b["time_to_target_s"]["value"] == pytest.approx(90 * 4.0)


def test_a_demo_cut_by_its_total_bound_says_so_and_compares_equal_work(tmp_path, capsys, caplog, monkeypatch):
    # an unreachable target: fast trains its third of the time, the baseline then trains alone until the bound
    monkeypatch.setenv("MONAI_FAST_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    args = [*TINY_DEMO, "--max-epochs", "2000", "--target", "0.99", "--epoch-multiple", "100", "--total-budget", "30"]
    with caplog.at_level("INFO", logger="monai_fast"):
        assert main(["demo", *args, "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    doc = json.loads((run / "results.json").read_text())
    head = doc["headline"]
    base, fast = head["recipes"]["baseline"], head["recipes"]["fast"]
    assert base["stopped"] == "total time bound" and "baseline" in head["budget"]["bound_stopped"]
    assert base["epochs_run"] < head["budget"]["others_epochs"]
    assert (
        f"baseline: stopped by the total time bound after {base['epochs_run']} of its "
        f"{head['budget']['others_epochs']} epochs"
    ) in out
    # equal work: the baseline's epoch trains twice fast's crops here, so its seconds per epoch are not compared
    assert fast["epoch_holds"]["train_crops_per_epoch"] < base["epoch_holds"]["train_crops_per_epoch"]
    sp = head["speedup"]
    assert "per_epoch" not in sp and "x per epoch" not in out
    rows = {r: [e for e in doc_r["epochs"]] for r, doc_r in ((x["recipe"], x) for x in doc["results"])}

    def per_crop(recipe: str) -> float:
        mine = rows[recipe][: head["recipes"][recipe]["epochs_interleaved"]]
        return sum(e["train_s"] for e in mine) / sum(e["train_samples"] for e in mine)

    assert sp["per_crop"] == pytest.approx(per_crop("baseline") / per_crop("fast"))
    validated = all(any(e["val_volumes"] for e in rows[r]) for r in rows)  # fast validates fully only now and then
    assert (sp["per_volume"] is not None and sp["per_volume"] > 0) == validated
    assert f"for equal work: training per crop {sp['per_crop']:.1f}x" in out and "an epoch held: fast " in out
    # the set-up lines: one per lever, none of them thousands of characters long
    setup = [r.getMessage() for r in caplog.records if r.name == "monai_fast.apps.training.run"]
    assert any(m.startswith("fast: set up in ") for m in setup) and max(map(len, setup)) < 400
    # fast's doctor: the baseline's turns are its pauses, not idle time to wrap in a span
    diagnosis = json.loads((run / "fast" / "doctor.json").read_text())
    assert diagnosis["numbers"]["wall_clock"]["seconds"]["paused"] > 0
    assert not any("RecordHandler.span('setup')" in f for f in diagnosis["fixes"])
    # its many turns (record segments of one process) read as one range, not a clause each
    segments = next(e for e in diagnosis["evidence"] if "segments (runs of the trainer" in e)
    assert re.search(r"segments 0-\d+ \(pid \d+\) each ended, the last to epoch", segments), segments
    assert len(segments) < 400 and "error" not in segments
    assert "to the end of training" in (run / "fast" / "report.md").read_text()
