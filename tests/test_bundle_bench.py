"""The bundle benchmark (``benchmarks/bundle.py``) and the Model Zoo sweep (``benchmarks/bundle_sweep.py``) at toy size.

Real parts: the test bundle ``tests/bundles/seg3d`` (the Model Zoo's layout) on synthetic NIfTI files, each run in
its own process through ``run_bundle`` / ``monai-fast bundle run``; for the sweep, a folder laid out as the Model
Zoo (``models/<bundle>/configs``) holding that bundle, a bundle whose network needs a package that is not installed,
and a bundle whose ``initialize`` section never returns.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from bundle_parts import ROOT, SEG3D

from monai_fast.apps.sources.synthetic import generate_msd

TINY = ["patch_size=[16,16,16]", "network_def#channels=[4,8]", "network_def#strides=[2]", "network_def#num_res_units=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_msd(tmp_path_factory.mktemp("bench-data"), num_cases=3, shape=(32, 32, 24), progress=False)


def _bench(data: Path, out: Path, *more: str) -> tuple[subprocess.CompletedProcess, dict]:
    """One ``benchmarks/bundle.py`` run of the test bundle at toy size (one round, 2 epochs); its output and JSON."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bundle.py"), "--bundle", str(SEG3D), "--repeats", "1"]
    cmd += ["--epochs", "2", *more, "--out", str(out), f"dataset_dir={data}", "num_val=1", *TINY]
    r = subprocess.run([*cmd, "device=$torch.device('cpu')"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = out.glob("bundle_seg3d_*.json")
    return r, json.loads(path.read_text())


def test_bundle_bench_pairs_published_and_fast_runs_and_its_table_says_what_its_json_says(data, tmp_path):
    r, doc = _bench(data, tmp_path / "results")
    assert doc["epochs"] == 2 and doc["repeats"] == 1 and doc["commit"]
    assert [run["variant"] for run in doc["runs"]] == ["published", "fast"]  # taking turns, published first
    published, fast = doc["runs"]
    assert published["applied"] == {} and fast["applied"]  # --no-fast attaches nothing
    assert {"data", "precision"} <= set(fast["applied"])
    assert set(doc["levers_applied"]) | set(doc["levers_left_alone"]) == set(fast["applied"])
    for run in doc["runs"]:
        assert [e["epoch"] for e in run["epochs"]] == [1, 2]
        for e in run["epochs"]:
            assert e["train_s"] > 0 and e["validation_s"] > 0  # the bundle validates every epoch
            assert e["epoch_s"] == pytest.approx(e["train_s"] + e["validation_s"], abs=1e-3)
        assert 0.0 <= run["metrics"]["validate/val_mean_dice"] <= 1.0
    assert doc["metric"] == "validate/val_mean_dice"
    (pair,) = doc["summary"]["pairs"]
    assert pair["published_s"] == published["epochs"][1]["epoch_s"]  # the epochs after the first
    assert pair["fast_s"] == fast["epochs"][1]["epoch_s"]
    assert pair["ratio"] == pytest.approx(pair["published_s"] / pair["fast_s"], rel=1e-3)
    assert doc["summary"]["median_ratio"] == pair["ratio"]
    assert pair["fast_metric"] == fast["metrics"]["validate/val_mean_dice"]
    rows = {ln.split("|")[2].strip(): ln for ln in r.stdout.splitlines() if ln.startswith("| 1 |")}
    assert f"| {pair['published_s']:.3f} | - |" in rows["published"]
    assert f"| {pair['fast_s']:.3f} | {pair['ratio']:.3f} |" in rows["fast"]
    # the compile and memory-format decisions, from the record
    assert rows["fast"].endswith(f"| {pair['fast_compile']} | {pair['fast_layout'] or '-'} |")
    assert pair["fast_layout"] == (fast["applied"].get("memory_format") or {}).get("setting")
    assert pair["run_ratio"] == pytest.approx(published["wall_s"] / fast["wall_s"], rel=1e-3)  # the whole run
    assert f"median ratio (published / fast): per epoch {pair['ratio']:.3f}, whole run {pair['run_ratio']:.3f}" in (
        r.stdout
    )
    assert "levers applied: data: " in r.stdout


def _zoo(tmp_path: Path) -> Path:
    """A folder in the Model Zoo's layout: seg3d, a bundle needing a missing package, and one that hangs."""
    models = tmp_path / "zoo" / "models"
    shutil.copytree(SEG3D, models / "seg3d")
    for name, change in (
        ("needs_pkg", {"network_def": {"_target_": "not_a_real_package.Net"}}),
        ("hangs", {"initialize": ["$__import__('time').sleep(3600)"]}),
    ):
        shutil.copytree(SEG3D, models / name)
        cfg = models / name / "configs" / "train.json"
        config = json.loads(cfg.read_text())
        config.update(change)
        cfg.write_text(json.dumps(config))
    return tmp_path / "zoo"


def _sweep(
    zoo: Path, out: Path, bundles: list[str], timeout: int, more: Sequence[str] = ()
) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bundle_sweep.py"),
        "--zoo",
        str(zoo),
        "--out",
        str(out),
        "--timeout",
        str(timeout),
        "--volume",
        "32",
        "32",
        "24",
        *more,
        "--bundles",
        *bundles,
        "--set",
        *TINY,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (path,) = out.glob("bundle_sweep_*.json")
    return r, json.loads(path.read_text())


def test_sweep_makes_a_row_per_bundle_and_a_crash_is_a_row_and_measures_the_speedup_of_what_trains(tmp_path):
    zoo = _zoo(tmp_path)
    more = ["--speedup-epochs", "2", "--repeats", "1", "--cases", "3", "2", "--plan"]
    r, doc = _sweep(zoo, tmp_path / "out", ["seg3d", "needs_pkg"], timeout=300, more=more)
    rows = {row["bundle"]: row for row in doc["rows"]}
    assert set(rows) == {"seg3d", "needs_pkg"}
    seg = rows["seg3d"]
    assert seg["builds"] and seg["trains"] and seg["iterations"] == 2 and seg["reason"] == ""
    assert "data" in seg["applied"] and "precision" in {**seg["applied"], **seg["left_alone"]}
    # only data lists, epochs, device and the sizes asked for are overridden
    assert seg["overrides"]["train#trainer#max_epochs"] == 1 and seg["overrides"]["train#trainer#epoch_length"] == 2
    assert seg["overrides"]["device"] == "$torch.device('cpu')"
    assert doc["cases"] == [3, 2]
    assert doc["plan"] and seg["speedup_plan_epochs"] == 100  # the runs kept the bundle's plan and stopped at 2
    bad = rows["needs_pkg"]
    assert not bad["builds"] and not bad["trains"] and "needs package not_a_real_package" in bad["reason"]
    assert doc["speedup_epochs"] == 2 and doc["repeats"] == 1
    # the speed-up: one pair (published, then fast) of 2-epoch runs, the first epoch left out
    (pair,) = seg["speedup_pairs"]
    assert seg["speedup_epochs"] == 2 and seg["speedup_validated"] and seg["speedup_reason"] == ""
    assert pair["published_s"] > 0 and pair["fast_s"] > 0
    assert seg["speedup"] == pair["ratio"] == pytest.approx(pair["published_s"] / pair["fast_s"], rel=1e-3)
    assert bad["speedup"] is None and bad["speedup_pairs"] == []  # nothing measured where nothing trains
    assert "| seg3d | yes | yes | data: user cache" in r.stdout
    seg_line = next(ln for ln in r.stdout.splitlines() if ln.startswith("| seg3d |"))
    assert pair["published_metric"] is not None and pair["fast_metric"] is not None  # the final validation Dice
    metrics = f"{pair['published_metric']:.3f} / {pair['fast_metric']:.3f}"
    assert f"| {seg['speedup']:.2f}x ({pair['ratio']:.2f}; 2 epochs) | {metrics} | - |" in seg_line
    assert "| needs_pkg | no | no | - | - | - | cannot locate not_a_real_package.Net: needs package" in r.stdout
    assert doc["machine"]["onednn_max_cpu_isa"] is None and isinstance(doc["machine"]["bf16_hardware"], bool)


def test_sweep_ends_a_hanging_bundle_at_its_time_limit(tmp_path):
    zoo = _zoo(tmp_path)
    r, doc = _sweep(zoo, tmp_path / "out", ["hangs"], timeout=10)
    (row,) = doc["rows"]
    assert not row["builds"] and not row["trains"]
    assert row["reason"] == "over the 10 s limit before two iterations"
    assert row["seconds"] < 60


def test_bundle_bench_keeps_the_bundles_plan_stops_after_the_epochs_asked_and_compares_each_variant(data, tmp_path):
    r, doc = _bench(data, tmp_path / "results", "--plan", "--variants", "published,eager,fast")
    assert doc["plan_epochs"] == 100 and doc["variants"] == ["published", "eager", "fast"]
    assert [run["variant"] for run in doc["runs"]] == ["published", "eager", "fast"]
    for run in doc["runs"]:
        assert [e["epoch"] for e in run["epochs"]] == [1, 2]  # stopped after 2 of the 100 planned epochs
    eager, fast = doc["runs"][1:]
    assert eager["applied"]["compile"]["reason"] == "switched off (compile=False)"
    assert "switched off" not in fast["applied"]["compile"]["reason"]
    (pair,) = doc["summary"]["pairs"]
    assert pair["ratio_eager"] == pytest.approx(pair["published_s"] / pair["eager_s"], rel=1e-3)
    assert doc["summary"]["median_ratio_eager"] == pair["ratio_eager"]
    assert doc["summary"]["median_ratio"] == pair["ratio"]
    assert "median ratio (published / eager): per epoch" in r.stdout
    assert "the bundle's plan kept (100 epochs)" in r.stdout


def test_bundle_bench_refuses_a_plan_no_longer_than_the_epochs_and_unknown_variants(tmp_path):
    bench = [sys.executable, str(ROOT / "benchmarks" / "bundle.py"), "--bundle", str(SEG3D)]
    r = subprocess.run([*bench, "--plan", "--epochs", "100"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "the bundle plans 100 epochs, not more than --epochs" in r.stderr
    for bad in ("fast,published", "published,eager", "published,fast,fast", "published,fast,turbo"):
        r = subprocess.run([*bench, "--variants", bad], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode != 0 and f"--variants {bad!r}: published first, fast among them, each once" in r.stderr


def test_sweep_prepares_the_training_and_validation_cases_asked(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bundle_sweep_mod", ROOT / "benchmarks" / "bundle_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sweep  # its dataclasses look their module up
    spec.loader.exec_module(sweep)
    prep = sweep.prepare(SEG3D, tmp_path, volume=(16, 16, 16), cases=(3, 2))
    lists = {k: v for k, v in prep.overrides.items() if k.endswith("#data")}
    assert sorted(len(v) for v in lists.values()) == [2, 3]
    files = [Path(p) for items in lists.values() for item in items for p in item.values() if isinstance(p, str)]
    assert len(files) == 10 and all(f.is_file() for f in files)  # an image and a label per case
