"""``monai-fast train`` under faults: SageMaker channels, a full model or output folder, stop signals during set-up,
a data folder given as a URL, and option texts that say what the command does.

Real parts: the command run in-process through ``main`` or as a real subprocess sent real signals; real tmpfs
file systems mounted for the test (root only; skipped with the reason otherwise); a real S3-compatible server
(``tests/s3_server.py``) on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from s3_server import s3_fixture, server_fixture  # noqa: F401 (pytest fixtures s3, server)

from monai_fast.apps.cli import main
from monai_fast.apps.cli.train import hyperparameter_values
from monai_fast.apps.inference.checkpoint import load_checkpoint
from monai_fast.apps.launch.sagemaker import SageMakerEnvError, read_sagemaker_env
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
    "--max-epochs",
    "1",
]


def _no_sagemaker(monkeypatch) -> None:
    for k in [k for k in os.environ if k.startswith("SM_")]:
        monkeypatch.delenv(k)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SM_")}


@pytest.fixture
def small_fs(tmpfs):
    """``small_fs(options, name)``: a real tmpfs mounted with those options (``tests/conftest.py``)."""
    return tmpfs


# ---------------------------------------------------------------------------------------------- SageMaker channels
def test_a_channel_not_named_training_is_the_data_the_job_trains_on(tmp_path, tiny_spleen, monkeypatch):
    _no_sagemaker(monkeypatch)
    monkeypatch.setenv("SM_CHANNEL_TRAIN", str(tiny_spleen))  # a common channel name: not 'training'
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(tmp_path / "output"))
    monkeypatch.setenv("SM_NUM_GPUS", "0")
    assert main(["train", *TINY]) == 0
    results = json.loads((tmp_path / "output" / "results.json").read_text())
    assert results["data"] == str(tiny_spleen)  # not synthetic volumes
    assert (tmp_path / "model" / "model.pth").is_file()


def test_without_a_channel_a_sagemaker_job_fails_naming_the_variables_read_and_writes_nothing(tmp_path, monkeypatch):
    _no_sagemaker(monkeypatch)
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(tmp_path / "output"))
    with pytest.raises(SystemExit) as caught:
        main(["train", *TINY])
    message = str(caught.value)
    assert "SM_MODEL_DIR" in message and "SM_OUTPUT_DATA_DIR" in message and "SM_CHANNEL_" in message, message
    assert "synthetic" in message and "\n" not in message
    assert not (tmp_path / "model").exists() and not (tmp_path / "output").exists()


def test_several_channels_need_training_or_a_named_one():
    env = read_sagemaker_env({"SM_CHANNEL_TRAIN": "/a", "SM_CHANNEL_EVAL": "/b"})
    several = r"several input channels.*SM_CHANNEL_EVAL=/b.*SM_CHANNEL_TRAIN=/a.*--channel"
    with pytest.raises(SageMakerEnvError, match=several):
        env.channel_dir()
    assert env.channel_dir("train") == Path("/a")
    with pytest.raises(SageMakerEnvError, match=r"SM_CHANNEL_TEST: no input channel 'test'"):
        env.channel_dir("test")
    both = read_sagemaker_env({"SM_CHANNEL_TRAINING": "/t", "SM_CHANNEL_VALIDATION": "/v"})
    assert both.channel_dir() == Path("/t")


def test_channel_outside_sagemaker_is_named(monkeypatch, tmp_path):
    _no_sagemaker(monkeypatch)
    with pytest.raises(SystemExit, match=r"--channel train names a SageMaker input channel.*no SageMaker variable"):
        main(["train", "--channel", "train", "--output-dir", str(tmp_path / "out"), *TINY])


def test_the_job_line_says_what_was_not_given_instead_of_none():
    line = read_sagemaker_env({"SM_MODEL_DIR": "/opt/ml/model", "SM_CHANNEL_TRAIN": "/data"}).describe()
    assert "None" not in line and "[]" not in line
    assert "SM_HOSTS not set" in line and "SM_NUM_GPUS not set" in line and "train=/data" in line
    two = read_sagemaker_env({"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "4"})
    assert two.describe().startswith("host algo-2 of 2 (algo-1, algo-2), 4 GPU(s)")


# ---------------------------------------------------------------------------------------------- full disks
def test_a_model_folder_too_small_for_the_model_is_named_before_any_data_is_read(
    small_fs, tmp_path, tiny_spleen, monkeypatch
):
    _no_sagemaker(monkeypatch)
    model_dir = small_fs("size=1m", "model")  # the default UNet's model.pth is ~0.6 MiB, with the margin > 1 MiB
    out = tmp_path / "out"
    start = time.monotonic()
    with pytest.raises(SystemExit) as caught:
        main(["train", "--data-dir", str(tiny_spleen), "--output-dir", str(out), "--model-dir", str(model_dir), *TINY])
    message = str(caught.value)
    assert str(model_dir / "model.pth") in message and "needs" in message and "free" in message, message
    assert "missing" in message and "\n" not in message
    assert not (out / "fast").exists()  # no run record: nothing was trained
    assert not any(model_dir.iterdir())
    assert time.monotonic() - start < 30


def test_a_sagemaker_model_dir_too_small_for_the_model_is_named_before_any_data_is_read(
    small_fs, tmp_path, tiny_spleen, monkeypatch
):
    _no_sagemaker(monkeypatch)
    model_dir = small_fs("size=1m", "sm-model")  # SM_MODEL_DIR: where the job's model.pth goes
    monkeypatch.setenv("SM_CHANNEL_TRAINING", str(tiny_spleen))
    monkeypatch.setenv("SM_MODEL_DIR", str(model_dir))
    monkeypatch.setenv("SM_OUTPUT_DATA_DIR", str(tmp_path / "output"))
    monkeypatch.setenv("SM_NUM_GPUS", "0")
    with pytest.raises(SystemExit) as caught:
        main(["train", *TINY])
    message = str(caught.value)
    assert str(model_dir / "model.pth") in message and "missing" in message and "\n" not in message, message
    assert not (tmp_path / "output" / "fast").exists() and not any(model_dir.iterdir())


def test_an_output_folder_that_fills_costs_only_its_files_and_the_model_is_written_first(
    small_fs, tmp_path, tiny_spleen
):
    # Out of inodes: the run folder, its recipe folder and the four files written during training (lock, TensorBoard
    # events, record, summary) fit in 7 with the mount's root; epochs.csv, written after training, does not.
    out = small_fs("size=4m,nr_inodes=7", "out")
    model_dir = tmp_path / "model"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "monai_fast.apps.cli",
            "train",
            "--data-dir",
            str(tiny_spleen),
            "--output-dir",
            str(out / "run"),
            "--model-dir",
            str(model_dir),
            *TINY,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    network, _ = load_checkpoint(model_dir / "model.pth")  # the model is whole
    assert (model_dir / "recipe.json").is_file()
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("monai-fast train: not written: ")]
    assert any(str(out / "run" / "fast" / "epochs.csv") in ln for ln in lines), proc.stderr[-3000:]
    assert any(str(out / "run" / "results.json") in ln for ln in lines), proc.stderr[-3000:]  # tried after epochs.csv
    assert "Traceback" not in proc.stderr
    assert f"model: {model_dir / 'model.pth'}" in proc.stdout and "results: not written" in proc.stdout
    assert not [p for p in out.rglob("*.tmp")]  # nothing half-written


# ---------------------------------------------------------------------------------------------- signals in set-up
def _signal_during_setup(cmd: list[str], cwd: Path, sig: signal.Signals) -> subprocess.CompletedProcess:
    """Start ``cmd``, send ``sig`` once its set-up has begun (the launcher's line, before data and caches), wait."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=cwd)
    try:
        seen = []
        for line in proc.stderr:  # the lines until set-up starts; the rest is read by communicate()
            seen.append(line)
            if "monai_fast.distributed: launcher" in line:
                break
        assert proc.poll() is None, "".join(seen)[-3000:]
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, "".join(seen) + stderr)


def test_a_signal_during_setup_with_a_checkpoint_folder_stops_at_the_runs_start_saying_so(tmp_path, tiny_spleen):
    sig = signal.SIGUSR1  # SLURM's warning before the time limit
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
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
        *TINY,
    ]
    done = _signal_during_setup(cmd, tmp_path, sig)
    assert done.returncode == STOPPED_EXIT, done.stderr[-3000:]
    assert f"{sig.name} received during set-up" in done.stderr
    assert f"preempted: {sig.name} before training started" in done.stdout, done.stdout
    assert not (out / "model" / "model.pth").exists()


def test_a_signal_during_setup_without_a_checkpoint_folder_stops_before_training_saying_so(tmp_path, tiny_spleen):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "monai_fast.apps.cli",
        "train",
        "--data-dir",
        str(tiny_spleen),
        "--output-dir",
        str(out),
        *TINY,
    ]
    done = _signal_during_setup(cmd, tmp_path, signal.SIGTERM)  # a spot reclaim
    assert done.returncode == STOPPED_EXIT, done.stderr[-3000:]
    assert "SIGTERM received during set-up; stopping before training" in done.stderr
    assert not (out / "model" / "model.pth").exists() and not (out / "results.json").exists()


# ---------------------------------------------------------------------------------------------- URL, option texts
@pytest.mark.timeout(300)
def test_a_data_dir_url_is_read_from_object_storage(s3, tiny_spleen, tmp_path, monkeypatch):
    _no_sagemaker(monkeypatch)
    client, bucket = s3
    for f in sorted(tiny_spleen.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"Task09/{f.relative_to(tiny_spleen).as_posix()}")
    url = f"s3://{bucket}/Task09"
    out = tmp_path / "out"
    assert main(["train", "--data-dir", url, "--output-dir", str(out), *TINY]) == 0
    assert json.loads((out / "results.json").read_text())["data"] == url
    assert (out / "model" / "model.pth").is_file()


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_train_takes_validation_like_demo_and_its_help_says_the_recipes_schedule(capsys):
    assert hyperparameter_values({"validation": "every_epoch", "val_interval": 2}, "SM_HPS") == {
        "validation": "every_epoch",
        "val_interval": 2,
    }
    for name in ("train", "demo"):
        text = _help(name, capsys)
        assert "--validation {every_epoch,schedule}" in text
        assert "with --validation every_epoch: validate every N epochs (default 1)" in text
        assert "fast: schedule" in text
    sbatch = _help("sbatch", capsys)
    nodes = sbatch.split("--nodes NODES", 2)[-1].split("--gpus-per-node")[0]
    assert "Kubernetes" not in nodes and "pod" not in nodes and "#SBATCH --nodes" in nodes
