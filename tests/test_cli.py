import csv
import json
import subprocess
import sys

import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from monai_fast.apps.cli import main
from monai_fast.telemetry.record import data_share

TINY = [
    "--cases",
    "5",
    "--shape",
    "48",
    "48",
    "32",
    "--patch-size",
    "32",
    "32",
    "32",
    "--num-samples",
    "2",
    "--workers",
    "1",
    "--no-progress",
]


def test_help_explains_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "monai_fast.apps.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for cmd in ("demo", "bench", "synth", "tune", "doctor"):
        assert cmd in out
    demo = subprocess.run(
        [sys.executable, "-m", "monai_fast.apps.cli", "demo", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for opt in ("--target", "--time-budget", "--data-dir", "--run-dir", "--device", "--recipes"):
        assert opt in demo


def test_the_package_docstring_lists_every_command():
    """The command list at the top of ``monai_fast.apps.cli`` names each command the parser has, and no other."""
    import argparse
    import importlib
    import re

    import monai_fast.apps.cli as cli

    sub = argparse.ArgumentParser(prog="monai-fast").add_subparsers(dest="command")
    for module, function in dict.fromkeys(cli.COMMANDS.values()):
        getattr(importlib.import_module(module), function)(sub)
    listed = re.findall(r"^``monai-fast (\w+)``", cli.__doc__, flags=re.MULTILINE)
    assert len(listed) == len(set(listed))
    assert set(listed) == set(sub.choices) == set(cli.COMMANDS)


def test_console_script_is_installed():
    import shutil
    from pathlib import Path

    beside = Path(sys.executable).parent / "monai-fast"  # the venv's bin/, also when it is not on PATH
    exe = str(beside) if beside.exists() else shutil.which("monai-fast")
    assert exe, "the monai-fast console script is not on PATH: install the package (pip install -e .)"
    assert "usage: monai-fast" in subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout


def test_demo_end_to_end_tiny(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(
        [
            "demo",
            *TINY,
            "--max-epochs",
            "2",
            "--time-budget",
            "120",
            "--budget-multiple",
            "100",
            "--target",
            "0.99",
            "--run-dir",
            str(run),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "time to target s" in out and "baseline" in out and "fast" in out and "data wait" in out
    assert "doctor, fast:" in out and "doctor, baseline:" in out
    for name in ("fast", "baseline"):
        assert (run / name / "report.md").is_file() and (run / name / "record.rank0.jsonl").is_file()

    doc = json.loads((run / "results.json").read_text())
    assert [r["recipe"] for r in doc["results"]] == ["fast", "baseline"]
    for r in doc["results"]:
        assert r["epochs_run"] == 2 and len(r["epochs"]) == 2
        share = data_share(sum(e["data_wait_s"] for e in r["epochs"]), sum(e["compute_s"] for e in r["epochs"]))
        assert r["data_wait_share"] == pytest.approx(share) and r["train_s_per_epoch"] > 0
    assert doc["machine"]["device"] and doc["versions"]["monai"]
    assert all(
        r["diagnosis"]["verdict"] in {"data-bound", "compute-bound", "gpu-under-filled", "balanced"}
        for r in doc["results"]
    )
    assert "fast" in doc["speedups"]

    with open(run / "epochs.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["recipe"] for r in rows} == {"fast", "baseline"}
    for r in doc["results"]:  # the CSV and the JSON tell the same epochs
        csv_dice = [float(x["val_dice"]) if x["val_dice"] else None for x in rows if x["recipe"] == r["recipe"]]
        assert csv_dice == [pytest.approx(e["val_dice"]) if e["val_dice"] is not None else None for e in r["epochs"]]
    assert [e["val_dice"] is None for e in doc["results"][0]["epochs"]] == [
        True,
        False,
    ]  # fast: estimate, then full (last)

    with Image.open(run / "dice_vs_time.png") as im:
        assert im.size[0] > 300 and im.size[1] > 200

    for name in ("fast", "baseline"):
        acc = EventAccumulator(str(run / name))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        assert {"val/mean_dice", "epoch/data_share", "train/loss", "throughput/samples_per_s"} <= set(tags)
        dice = [e.value for e in acc.Scalars("val/mean_dice")]  # one per full validation
        assert dice == pytest.approx([float(r["val_dice"]) for r in rows if r["recipe"] == name and r["val_dice"]])
        assert len(dice) == {"fast": 1, "baseline": 2}[name]

    # the second run reuses the cached synthetic data instead of writing it again
    data_dirs = list((tmp_path / "cache" / "data").iterdir())
    assert len(data_dirs) == 1
    stamp = (data_dirs[0] / "dataset.json").stat().st_mtime_ns
    main(["demo", *TINY, "--recipes", "fast", "--max-epochs", "1", "--run-dir", str(tmp_path / "run2")])
    assert (data_dirs[0] / "dataset.json").stat().st_mtime_ns == stamp


def test_demo_on_user_data_dir_and_bad_dir(tmp_path, tiny_spleen):
    run = tmp_path / "run"
    main(
        [
            "demo",
            "--data-dir",
            str(tiny_spleen),
            "--recipes",
            "fast",
            "--max-epochs",
            "1",
            "--patch-size",
            "32",
            "32",
            "32",
            "--num-samples",
            "2",
            "--no-progress",
            "--run-dir",
            str(run),
        ]
    )
    assert json.loads((run / "results.json").read_text())["data"] == str(tiny_spleen)
    with pytest.raises(SystemExit, match="monai-fast demo: .*dataset.json"):
        main(["demo", "--data-dir", str(tmp_path), "--no-progress", "--run-dir", str(tmp_path / "r3")])


def test_bench_writes_json_with_repeats(tmp_path):
    out = tmp_path / "results"
    main(
        [
            "bench",
            *TINY,
            "--recipes",
            "baseline",
            "fast",
            "--repeats",
            "2",
            "--max-epochs",
            "1",
            "--run-dir",
            str(tmp_path / "b"),
            "--out",
            str(out),
        ]
    )
    (path,) = out.glob("time_to_dice_*.json")
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "time_to_dice" and len(doc["repeats"]) == 2
    assert set(doc["summary"]) == {"baseline", "fast"}
    assert len(doc["summary"]["fast"]["speedup_over_baseline"]) == 2
    assert "speedup_over_monai_tutorial" not in doc["summary"]["fast"]  # not raced in this run
    # repeats differ in training seed, not in data
    assert doc["repeats"][0][0]["epochs"][0]["loss"] != doc["repeats"][1][0]["epochs"][0]["loss"]


def test_synth_command(tmp_path, capsys):
    main(
        [
            "synth",
            str(tmp_path / "b"),
            "--kind",
            "brats-like",
            "--cases",
            "2",
            "--shape",
            "24",
            "24",
            "24",
            "--no-progress",
        ]
    )
    assert json.loads((tmp_path / "b" / "dataset.json").read_text())["numTraining"] == 2


@pytest.mark.parametrize(
    "argv, match",
    [
        (["demo", "--cases", "0"], "--cases"),
        (["demo", "--time-budget", "0"], "--time-budget"),
        (["demo", "--batch-size", "0", "--cases", "3", "--shape", "16", "16", "16"], "batch_size"),
        (["demo", "--device", "cuda:0", "--cases", "3", "--shape", "16", "16", "16"], "CUDA"),
    ],
)
def test_bad_cli_options_are_named(argv, match, capsys):
    import torch

    if "cuda:0" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit, match=match):
        main([*argv, "--no-progress"])


def test_sbatch_options_reach_the_script(tmp_path, capsys):
    """Each job-writer option lands in the spec field of its name: requeue off, the signal lead, the memory."""
    out = tmp_path / "job.sbatch"
    argv = ["sbatch", "--no-requeue", "--signal-lead", "30", "--mem", "64G", "--out", str(out), "--", "python", "t.py"]
    assert main(argv) == 0
    text = out.read_text()
    assert "--requeue" not in text and "USR1@30" in text and "--mem=64G" in text
    assert main(["sbatch", "--", "python", "t.py"]) == 0
    assert "#SBATCH --requeue" in capsys.readouterr().out


def test_unwritable_run_dir_is_named_before_any_training(tmp_path, monkeypatch):
    import monai_fast.apps.demo.core as race_core

    def no_training(*a, **k):
        raise AssertionError("trained although --run-dir cannot be written")

    monkeypatch.setattr(race_core, "run_to_target", no_training)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="monai-fast demo: --run-dir: cannot write into"):
        main(["demo", *TINY, "--run-dir", str(tmp_path / "a-file" / "run")])
    with pytest.raises(SystemExit, match="monai-fast demo: --target: must be in"):
        main(["demo", *TINY, "--target", "1.2", "--run-dir", str(tmp_path / "r")])


def test_tune_command_then_demo_applies_the_cached_pick(tmp_path, capsys):
    tiny = [
        "--cases",
        "5",
        "--shape",
        "48",
        "48",
        "32",
        "--patch-size",
        "32",
        "32",
        "32",
        "--num-samples",
        "2",
        "--no-progress",
    ]
    # --precision fp32: the precision is part of the tuning key; a CPU's bf16 measurement can differ between processes
    search = [
        "--batch-range",
        "1",
        "2",
        "--sw-range",
        "1",
        "2",
        "--trials",
        "2",
        "--tune-cache",
        str(tmp_path / "t.json"),
        "--place-cache",
        "--precision=fp32",
    ]
    assert main(["tune", *tiny, *search, "--out", str(tmp_path / "tune.json")]) == 0
    out = capsys.readouterr().out
    assert "pick: batch_size=" in out and "sw_batch_size=" in out and "cache: ram," in out
    picked = json.loads((tmp_path / "tune.json").read_text())["tuning"]
    assert picked["batch_size"] in (1, 2) and picked["trials"] and picked["cache_where"] == "ram"
    # the demo reads the same pick from the cache (nothing re-measured) and trains fast with it
    run = tmp_path / "run"
    main(
        [
            "demo",
            *tiny,
            "--workers",
            "1",
            *search,
            "--tune",
            "--recipes",
            "fast",
            "--max-epochs",
            "1",
            "--run-dir",
            str(run),
        ]
    )
    out = capsys.readouterr().out
    assert f"tuned fast: batch_size={picked['batch_size']}, sw_batch_size={picked['sw_batch_size']}" in out
    assert f"cache ram ({picked['cache_budget_mib']:.0f} MiB left for it)" in out
    assert "from the tuning cache" in out
    assert json.loads((run / "results.json").read_text())["tuning"]["from_cache"] is True


def test_tune_command_names_bad_ranges():
    with pytest.raises(SystemExit, match="batch_range"):
        main(["tune", "--cases", "3", "--shape", "16", "16", "16", "--batch-range", "4", "2", "--no-progress"])


def test_add_options_takes_keywords_as_a_fifth_item_and_names_an_option_with_more():
    import argparse

    from monai_fast.apps.cli import add_options

    parser = argparse.ArgumentParser()
    add_options(parser, [("--a", int, 1, "a"), ("--b", int, None, "b", {"nargs": 2, "metavar": "N"})])
    assert vars(parser.parse_args(["--b", "3", "4"])) == {"a": 1, "b": [3, 4]}
    with pytest.raises(ValueError, match="--c: .* got 6 items"):
        add_options(parser, [("--c", int, 1, "c", {}, "stray")])
