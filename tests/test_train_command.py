"""``monai-fast train`` in a temporary /opt/ml-shaped tree, as the SageMaker training toolkit sets it up, and as a
plain CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from monai.networks.nets import SegResNet, UNet
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from monai_fast.apps.cli import main
from monai_fast.apps.inference.checkpoint import load_checkpoint
from monai_fast.apps.launch.sagemaker import MASTER_PORT, SageMakerEnvError, read_sagemaker_env, torchrun_command
from monai_fast.apps.recipes import RecipeConfig
from monai_fast.apps.sources.synthetic import generate_msd

TINY = ["--patch-size", "32", "32", "32", "--num-samples", "2", "--val-fraction", "0.34", "--no-progress"]


def sagemaker_tree(root, hyperparameters: dict) -> dict[str, str]:
    """/opt/ml under ``root``: the training channel (tiny spleen-like MSD set), config, model and output folders,
    and the variables the toolkit sets for one CPU host."""
    ml = root / "opt" / "ml"
    generate_msd(ml / "input" / "data" / "training", num_cases=5, shape=(48, 48, 32), progress=False)
    (ml / "input" / "config").mkdir(parents=True)
    (ml / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hyperparameters))
    for sub in ("model", "output/data"):
        (ml / sub).mkdir(parents=True)
    return {
        "SM_CHANNELS": '["training"]',
        "SM_CHANNEL_TRAINING": str(ml / "input" / "data" / "training"),
        "SM_MODEL_DIR": str(ml / "model"),
        "SM_OUTPUT_DIR": str(ml / "output"),
        "SM_OUTPUT_DATA_DIR": str(ml / "output" / "data"),
        "SM_INPUT_DIR": str(ml / "input"),
        "SM_INPUT_CONFIG_DIR": str(ml / "input" / "config"),
        "SM_NUM_GPUS": "0",
        "SM_NUM_CPUS": "2",
        "SM_HOSTS": '["algo-1"]',
        "SM_CURRENT_HOST": "algo-1",
    }


def _without_sagemaker() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SM_")}


def test_train_in_a_sagemaker_tree_writes_model_report_and_tensorboard_where_sagemaker_collects(tmp_path):
    # as SageMaker writes hyperparameters.json: every value a string, JSON-encoded by the SDK or plain
    hps = {
        "epochs": "3",
        "network": '"segresnet"',
        "channels": "8 16 32",
        "patch_size": "[32, 32, 32]",
        "num_samples": "2",
        "val_fraction": "0.34",
        "sagemaker_program": '"train.py"',
        "sagemaker_region": '"eu-west-1"',
    }
    env = {**_without_sagemaker(), **sagemaker_tree(tmp_path, hps)}
    proc = subprocess.run(
        [sys.executable, "-m", "monai_fast.apps.cli", "train", "--max-epochs", "1", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ml = tmp_path / "opt" / "ml"

    saved = json.loads((ml / "model" / "recipe.json").read_text())
    assert saved["recipe"] == "fast" and saved["config"]["network"] == "segresnet"
    network, config = load_checkpoint(ml / "model" / "model.pth")  # what monai-fast infer reads; strict load
    assert isinstance(network, SegResNet) and config == RecipeConfig.from_dict(saved["config"])

    results = json.loads((ml / "output" / "data" / "results.json").read_text())
    assert results["results"][0]["epochs_run"] == 1  # the command line's --max-epochs 1 beat the hyperparameter's 3
    assert results["data"] == env["SM_CHANNEL_TRAINING"]
    for name in ("report.md", "record.rank0.jsonl", "epochs.csv"):
        assert (ml / "output" / "data" / "fast" / name).is_file(), name
    assert (ml / "output" / "data" / "dice_vs_time.png").is_file()

    events = EventAccumulator(str(ml / "output" / "tensorboard"))
    events.Reload()
    assert {"train/loss", "val_mean_dice"} <= set(events.Tags()["scalars"])
    assert f"model: {ml / 'model' / 'model.pth'}" in proc.stdout


def test_train_without_sagemaker_is_an_ordinary_cli(tmp_path, tiny_spleen, monkeypatch, capsys):
    for k in [k for k in os.environ if k.startswith("SM_")]:
        monkeypatch.delenv(k)
    out = tmp_path / "out"
    assert (
        main(
            [
                "train",
                "--data-dir",
                str(tiny_spleen),
                "--output-dir",
                str(out),
                "--max-epochs",
                "1",
                "--device",
                "cpu",
                *TINY,
            ]
        )
        == 0
    )
    network, _ = load_checkpoint(out / "model" / "model.pth")
    assert isinstance(network, UNet)
    assert (out / "fast" / "report.md").is_file() and not (out / "tensorboard").exists()
    assert "best validation Dice" in capsys.readouterr().out


def test_two_hosts_meet_at_the_first_on_the_toolkits_port():
    env = read_sagemaker_env({"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "8"})
    assert env.hosts == ("algo-1", "algo-2") and env.node_rank == 1
    cmd = torchrun_command(env, ["-m", "monai_fast.apps.cli", "train", "--epochs", "5"])
    assert cmd == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "8",
        "--master_addr",
        "algo-1",
        "--master_port",
        str(MASTER_PORT),
        "--node_rank",
        "1",
        "-m",
        "monai_fast.apps.cli",
        "train",
        "--epochs",
        "5",
    ]
    assert MASTER_PORT == 7777
    first = read_sagemaker_env({"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-1", "SM_NUM_GPUS": "0"})
    assert torchrun_command(first, ["x.py"])[3:13:2] == [
        "--nnodes",
        "--nproc_per_node",
        "--master_addr",
        "--master_port",
        "--node_rank",
    ]
    assert torchrun_command(first, ["x.py"])[4:14:2] == ["2", "1", "algo-1", "7777", "0"]  # a CPU host: one process
    with pytest.raises(SageMakerEnvError, match="SM_HOSTS"):
        torchrun_command(read_sagemaker_env({"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1"}), ["x.py"])


def test_hyperparameters_come_from_sm_hps_before_the_file_with_values_as_json_or_strings(tmp_path):
    (tmp_path / "hyperparameters.json").write_text(json.dumps({"epochs": "9"}))
    env = read_sagemaker_env(
        {
            "SM_HPS": json.dumps({"epochs": 2, "network": "segresnet", "no_progress": "true", "lr": "0.001"}),
            "SM_INPUT_CONFIG_DIR": str(tmp_path),
        }
    )
    assert env.hyperparameters == {"epochs": 2, "network": "segresnet", "no_progress": True, "lr": 0.001}
    assert env.hyperparameters_from == "SM_HPS"
    from_file = read_sagemaker_env({"SM_INPUT_CONFIG_DIR": str(tmp_path)})
    assert from_file.hyperparameters == {"epochs": 9} and from_file.hyperparameters_from.endswith(
        "hyperparameters.json"
    )
    assert not read_sagemaker_env({}).present


def test_a_second_train_into_a_folder_in_use_stops_at_once_in_one_line(tmp_path, tiny_spleen):
    out = tmp_path / "out"
    hold = (
        "import sys, time; from monai_fast.telemetry.run_record import record_lock; "
        f"record_lock({str(out / 'fast')!r}, 0, what='the first run').acquire(); "
        "print('held', flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "held"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SM_")}
        t0 = time.monotonic()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "monai_fast",
                "train",
                "--data-dir",
                str(tiny_spleen),
                "--output-dir",
                str(out),
                "--max-epochs",
                "1",
                "--device",
                "cpu",
                *TINY,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert "in use by another run" in r.stderr and f"pid {owner.pid}" in r.stderr
        assert "preflight" not in r.stderr and time.monotonic() - t0 < 60  # stopped before reading any data
        assert not (out / "model" / "model.pth").exists()
    finally:
        owner.kill()
        owner.wait()
