"""``monai-fast demo`` bounded in time: it says up front how long it takes at most and keeps to it on any machine;
the baseline's printed epoch budget is the one it trains (``--max-epochs`` included); an estimate shows its range.

The demos are real (real MONAI engines, real synthetic NIfTI files), tiny, and cannot reach their target, so
only the bounds stop them.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from monai_fast.apps.cli import main
from monai_fast.apps.demo.core import report_reserve_s
from monai_fast.apps.demo.headline import ESTIMATED, format_headline, headline
from monai_fast.apps.training.run import EpochRow, TrainResult

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
    "--target",
    "0.99",
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MONAI_FAST_CACHE", str(tmp_path / "cache"))


def test_the_demo_says_its_bound_up_front_and_ends_within_it(tmp_path, capsys, cache):
    bound = 50.0  # its reserve for the reports (at least 10 s) holds a report phase of 1.5 s slowed 6x
    started = time.monotonic()
    assert (
        main(
            [
                "demo",
                *TINY_DEMO,
                "--max-epochs",
                "500",
                "--total-budget",
                f"{bound:g}",
                "--run-dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    took = time.monotonic() - started
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[2] == (
        "time: at most 50 s (50 s) from here on any machine: data, set-up, training of fast and "
        "baseline, reports (--total-budget)"
    ), out
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    clock = doc["clock"]  # where the time went: set-up, training, headline and doctor, the share kept for reports
    assert clock["total_budget_s"] == bound and clock["reports_reserved_s"] == pytest.approx(report_reserve_s(bound))
    assert clock["reports_reserved_s"] == pytest.approx(10.0)  # a short bound keeps more than its 15 % share
    assert took < bound, (took, clock, out)
    recipes = doc["headline"]["recipes"]
    # only the clock stopped them, and both trained: the headline has their measured seconds per epoch
    assert recipes["fast"]["epochs_run"] >= 1 and recipes["baseline"]["epochs_run"] >= 1, out
    assert recipes["fast"]["epochs_run"] < 500 and recipes["baseline"]["epochs_run"] < 500
    assert doc["headline"]["speedup"]["per_crop"] > 0  # training seconds per crop, the recipes side by side
    assert re.search(r"-- fast: up to \d+ s on its own clock \(set-up included\): its share of the \d+ s left", out), (
        out
    )
    assert re.search(r"-- baseline: budget .*\(\d+ s left of --total-budget\) on its own clock", out), out


def test_the_printed_epoch_budget_is_the_one_trained_under_max_epochs(tmp_path, capsys, cache):
    assert (
        main(
            [
                "demo",
                *TINY_DEMO,
                "--max-epochs",
                "2",
                "--epoch-multiple",
                "4",
                "--total-budget",
                "300",
                "--run-dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "at most 2 epochs (--max-epochs)" in out.splitlines()[1], out
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    budget = doc["headline"]["budget"]
    assert budget["lead_epochs"] == 2 and budget["others_epochs"] == 2 and budget["max_epochs"] == 2
    if doc["headline"]["recipes"]["baseline"]["epochs_interleaved"] < 2:  # it trains on after fast: its budget is said
        assert "-- baseline: budget 2 epochs (fast ran 2 epochs" in out
        assert "4x its epochs = 8, capped by --max-epochs 2" in out
    assert "budget 8 epochs" not in out
    assert doc["headline"]["recipes"]["baseline"]["epochs_run"] == 2
    assert doc["headline"]["recipes"]["baseline"]["stopped"] == "epoch budget"


def test_a_bad_total_budget_is_named_before_anything_runs(tmp_path, cache):
    with pytest.raises(SystemExit, match=r"--total-budget must be >= 0 seconds \(0: no bound\), got -5"):
        main(["demo", *TINY_DEMO, "--total-budget", "-5", "--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def _result(recipe: str, dice: list[float], seconds: list[float], reached_at: int | None = None) -> TrainResult:
    rows, clock = [], 0.0
    for i, (d, s) in enumerate(zip(dice, seconds)):
        clock += s
        rows.append(EpochRow(recipe, i + 1, clock, s * 0.8, s * 0.2, 0.0, 1.0, 0.0, 1.0, d, wall_s=s))
    reached = reached_at is not None
    return TrainResult(
        recipe,
        0.9,
        reached,
        sum(seconds[:reached_at]) if reached else None,
        reached_at,
        len(rows),
        max(dice),
        0.0,
        clock,
        0.8,
        0.2,
        0.1,
        100.0,
        not reached,
        "cpu",
        False,
        epochs=rows,
    )


def test_an_estimate_shows_its_range_from_the_spread_of_its_epochs():
    fast = _result("fast", [0.3, 0.6, 0.9], [1.0, 1.0, 1.0], reached_at=3)
    base = _result("baseline", [0.1, 0.2, 0.3, 0.4], [3.0, 5.0, 4.0, 4.0])  # a noisy host: 3 to 5 s per epoch
    doc = headline([fast, base], {"fast": 3, "baseline": 4}, {"time_budget_s": 300})
    est = doc["recipes"]["baseline"]["time_to_target_s"]
    assert est["how"] == ESTIMATED and est["low"] < est["value"] < est["high"]
    epochs = doc["recipes"]["baseline"]["epochs_to_target"]
    assert est["low"] == pytest.approx(epochs["low"] * 3.0) and est["high"] == pytest.approx(epochs["high"] * 5.0)
    sp = doc["speedup"]
    assert sp["low"] < sp["factor"] < sp["high"]
    table = format_headline(doc)
    assert f"range {sp['low']:.1f}x-{sp['high']:.1f}x" in table
    assert re.search(
        r"baseline time to target: estimated: .*range \d+-\d+ s: [\d.]+-[\d.]+ epochs x its fastest and "
        r"slowest epoch \(3\.00-5\.00 s\)",
        table,
    ), table
