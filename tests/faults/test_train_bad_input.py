"""``monai-fast train``: a bad hyperparameter or SageMaker variable is named in one line before anything is trained."""

from __future__ import annotations

import json
import os

import pytest

from monai_fast.apps.cli import main


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A SageMaker-like environment with empty model, output and channel folders; returns them."""
    for k in [k for k in os.environ if k.startswith("SM_")]:
        monkeypatch.delenv(k)
    dirs = {
        "SM_MODEL_DIR": tmp_path / "model",
        "SM_OUTPUT_DATA_DIR": tmp_path / "output" / "data",
        "SM_INPUT_CONFIG_DIR": tmp_path / "config",
        "SM_CHANNEL_TRAINING": tmp_path / "training",
    }
    for name, folder in dirs.items():
        folder.mkdir(parents=True)
        monkeypatch.setenv(name, str(folder))
    monkeypatch.setenv("SM_NUM_GPUS", "0")
    return dirs


def _nothing_written(job) -> bool:
    return not any(job["SM_MODEL_DIR"].iterdir()) and not any(job["SM_OUTPUT_DATA_DIR"].iterdir())


@pytest.mark.parametrize(
    "hps, named",
    [
        (
            {"epochs": "abc"},
            "hyperparameter 'epochs' (from SM_HPS): argument --max-epochs/--epochs: invalid int value: 'abc'",
        ),
        ({"network": "vnet"}, "hyperparameter 'network' (from SM_HPS): argument --network: invalid choice: 'vnet'"),
        ({"epoch": 2}, "hyperparameter 'epoch' (from SM_HPS): is not an option of monai-fast train"),
        ({"no_preflight": 3}, "hyperparameter 'no_preflight' (from SM_HPS): takes no value, got 3"),
    ],
)
def test_a_bad_hyperparameter_is_named_in_one_line_before_training(job, monkeypatch, hps, named):
    monkeypatch.setenv("SM_HPS", json.dumps({"max_epochs": 1, **hps}))
    with pytest.raises(SystemExit) as caught:
        main(["train"])
    message = str(caught.value)
    assert message.startswith("monai-fast train: ") and named in message and "\n" not in message
    assert _nothing_written(job)


def test_a_bad_value_in_hyperparameters_json_names_the_file(job):
    path = job["SM_INPUT_CONFIG_DIR"] / "hyperparameters.json"
    path.write_text(json.dumps({"val_interval": "often"}))
    with pytest.raises(SystemExit, match=f"hyperparameter 'val_interval' \\(from {path}\\): argument --val-interval"):
        main(["train"])
    assert _nothing_written(job)


def test_a_network_option_the_network_cannot_take_is_named_before_training(job, monkeypatch):
    monkeypatch.setenv("SM_HPS", json.dumps({"network": "segresnet", "channels": [12, 24]}))
    with pytest.raises(SystemExit, match=r"monai-fast train: bad option: network 'segresnet'.*channels must be like"):
        main(["train", "--no-progress"])
    assert _nothing_written(job)


@pytest.mark.parametrize(
    "env, named",
    [
        ({"SM_HOSTS": "algo-1,algo-2", "SM_CURRENT_HOST": "algo-1"}, "SM_HOSTS: is not JSON"),
        (
            {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-3"},
            "SM_CURRENT_HOST: 'algo-3' is not one of SM_HOSTS",
        ),
        ({"SM_NUM_GPUS": "two"}, "SM_NUM_GPUS: must be a whole number, got 'two'"),
        ({"SM_HPS": '["epochs", 1]'}, "SM_HPS: must be a JSON dict"),
    ],
)
def test_a_bad_sagemaker_variable_is_named(job, monkeypatch, env, named):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as caught:
        main(["train"])
    assert str(caught.value).startswith("monai-fast train: SageMaker environment: ") and named in str(caught.value)
    assert _nothing_written(job)


def test_an_unwritable_model_dir_is_named_before_training(job, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the model folder should be")
    monkeypatch.setenv("SM_MODEL_DIR", str(blocker / "model"))
    monkeypatch.setenv("SM_HPS", json.dumps({"max_epochs": 1}))
    with pytest.raises(SystemExit, match=f"monai-fast train: --model-dir: cannot write into {blocker / 'model'}"):
        main(["train", "--no-progress"])
    assert not any(job["SM_OUTPUT_DATA_DIR"].iterdir())
