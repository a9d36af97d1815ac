"""``monai-fast train --checkpoint-dir``: a SIGTERM (a spot reclaim) checkpoints and exits 143, the same command
resumes and writes the model; SageMaker's /opt/ml/checkpoints is the default there; a bad --save-every is named."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from monai_fast.apps.cli import main
from monai_fast.apps.launch.sagemaker import read_sagemaker_env
from monai_fast.handlers.preemption import STOPPED_EXIT

TINY = [
    "--patch-size",
    "32",
    "32",
    "32",
    "--num-samples",
    "2",
    "--val-fraction",
    "0.34",
    "--no-progress",
    "--device",
    "cpu",
]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SM_")}


def test_sigterm_checkpoints_and_exits_143_then_the_same_command_resumes_and_writes_the_model(tmp_path, tiny_spleen):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "monai_fast.apps.cli",
        "train",
        "--data-dir",
        str(tiny_spleen),
        "--output-dir",
        str(out),
        "--checkpoint-dir",
        str(ckpt),
        "--save-every",
        "1",
        "--max-epochs",
        "4",
        *TINY,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    lines: list[str] = []  # the run's log, read as it comes: the stop lands after epoch 1, inside epoch 2
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any(" epoch 1: " in line for line in lines) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before its first epoch did"
        proc.send_signal(signal.SIGTERM)
        stdout = proc.stdout.read()
        proc.wait(timeout=300)
        reader.join(timeout=60)
        stderr = "".join(lines)
    finally:
        proc.kill()
    assert proc.returncode == STOPPED_EXIT, stderr[-3000:]
    assert "preempted: checkpointed at iteration" in stdout and not (out / "model" / "model.pth").exists()

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Preemption: resumed from" in done.stderr and (out / "model" / "model.pth").is_file()
    # the results cover the whole run, the epochs before the stop included, each epoch once
    results = json.loads((out / "results.json").read_text())["results"][0]
    assert results["epochs_run"] == 4 and [e["epoch"] for e in results["epochs"]] == [1, 2, 3, 4], results
    with open(out / "epochs.csv", newline="") as f:
        assert [int(row["epoch"]) for row in csv.DictReader(f)] == [1, 2, 3, 4]
    assert results["total_s"] > sum(e["train_s"] for e in results["epochs"][:1])


def test_save_every_without_a_checkpoint_folder_is_named_before_training(tmp_path, tiny_spleen, monkeypatch):
    for k in [k for k in os.environ if k.startswith("SM_")]:
        monkeypatch.delenv(k)
    with pytest.raises(SystemExit, match="--save-every"):
        main(
            ["train", "--data-dir", str(tiny_spleen), "--output-dir", str(tmp_path / "out"), "--save-every", "3", *TINY]
        )
    assert not (tmp_path / "out").exists()


def test_sagemakers_checkpoint_folder_is_the_default_only_where_the_job_has_one(tmp_path):
    ml = tmp_path / "opt" / "ml"
    (ml / "model").mkdir(parents=True)
    env = {"SM_MODEL_DIR": str(ml / "model")}
    assert read_sagemaker_env(env).checkpoint_dir is None
    (ml / "checkpoints").mkdir()
    assert read_sagemaker_env(env).checkpoint_dir == ml / "checkpoints"


def test_a_fresh_run_into_a_folder_holding_another_runs_record_is_refused_in_one_line(tmp_path, tiny_spleen):
    out = tmp_path / "out"
    args = ["train", "--data-dir", str(tiny_spleen), "--output-dir", str(out), "--max-epochs", "1", *TINY]
    assert main(args) == 0
    record = out / "fast" / "record.rank0.jsonl"
    before = record.read_bytes()
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert str(stop.value.code).startswith(f"monai-fast train: --output-dir: {out} holds another run's record")
    assert record.read_bytes() == before  # the first run's record is not appended to
