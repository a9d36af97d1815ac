"""A user's mistake in a bundle ends ``bundle run`` in one line naming the file, id or folder at fault.

Real parts: small bundles written here in the Model Zoo's layout (``configs/train.json`` or ``.yaml``), parsed by
MONAI's own ``ConfigWorkflow`` through :func:`~monai_fast.bundle.run_bundle` and ``monai-fast bundle run`` in
a subprocess, on synthetic NIfTI files; a read-only bundle folder is a read-only bind mount in a mount
namespace of the command's own (``unshare -m``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.bundle import BundleError, run_bundle

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_msd(tmp_path_factory.mktemp("bundle-errors-data"), num_cases=3, shape=(24, 24, 16), progress=False)


def config(data: Path) -> dict:
    """A 3-D segmentation bundle small enough for a 2-core CPU: tiny UNet, one epoch, no evaluator."""
    keys = ["image", "label"]
    return {
        "imports": ["$import glob"],
        "bundle_root": ".",
        "output_dir": "$@bundle_root + '/eval'",
        "dataset_dir": str(data),
        "images": "$sorted(glob.glob(@dataset_dir + '/imagesTr/*.nii.gz'))",
        "labels": "$sorted(glob.glob(@dataset_dir + '/labelsTr/*.nii.gz'))",
        "num_val": 1,
        "max_epochs": 1,
        "patch_size": [16, 16, 16],
        "device": "$torch.device('cpu')",
        "network": {
            "_target_": "UNet",
            "spatial_dims": 3,
            "in_channels": 1,
            "out_channels": 2,
            "channels": [4, 8],
            "strides": [2],
            "num_res_units": 0,
        },
        "loss": {"_target_": "DiceLoss", "to_onehot_y": True, "softmax": True},
        "optimizer": {"_target_": "torch.optim.Adam", "params": "$@network.parameters()", "lr": 0.001},
        "train": {
            "transforms": {
                "_target_": "Compose",
                "transforms": [
                    {"_target_": "LoadImaged", "keys": keys},
                    {"_target_": "EnsureChannelFirstd", "keys": keys},
                    {
                        "_target_": "RandCropByPosNegLabeld",
                        "keys": keys,
                        "label_key": "label",
                        "spatial_size": "@patch_size",
                        "num_samples": 1,
                    },
                ],
            },
            "dataset": {
                "_target_": "Dataset",
                "data": "$[{'image': i, 'label': l} for i, l in zip(@images[:-@num_val], @labels[:-@num_val])]",
                "transform": "@train#transforms",
            },
            "dataloader": {
                "_target_": "DataLoader",
                "dataset": "@train#dataset",
                "batch_size": 1,
                "shuffle": True,
                "num_workers": 0,
            },
            "trainer": {
                "_target_": "SupervisedTrainer",
                "max_epochs": "@max_epochs",
                "device": "@device",
                "train_data_loader": "@train#dataloader",
                "network": "@network",
                "loss_function": "@loss",
                "optimizer": "@optimizer",
            },
        },
        "run": ["$@train#trainer.run()"],
    }


def write_bundle(root: Path, cfg: dict | str, name: str = "train.json") -> Path:
    """A bundle folder with ``configs/<name>`` holding ``cfg`` (a dict as JSON, or the text as given)."""
    (root / "configs").mkdir(parents=True, exist_ok=True)
    (root / "configs" / name).write_text(cfg if isinstance(cfg, str) else json.dumps(cfg, indent=1))
    return root


def trained(bundle: Path) -> bool:
    return (bundle / "eval" / "monai_fast").is_dir() and any((bundle / "eval" / "monai_fast").iterdir())


def cli(
    bundle: Path, *args: str, prefix: tuple[str, ...] = (), logging_file: bool = False
) -> subprocess.CompletedProcess:
    quiet = [] if logging_file else ["--no-logging-file"]
    cmd = [*prefix, sys.executable, "-m", "monai_fast", "bundle", "run", str(bundle), *quiet, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def one_line(r: subprocess.CompletedProcess) -> str:
    """The command's last line, checked to be its only error output: no traceback."""
    assert r.returncode != 0, r.stdout[-2000:]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    return r.stderr.strip().splitlines()[-1]


def test_a_malformed_json_config_is_named_with_its_line_and_column(tmp_path, data):
    text = json.dumps(config(data), indent=1).replace('"num_val": 1,', '"num_val": 1,,')
    bundle = write_bundle(tmp_path / "b", text)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "num_val" in s)
    with pytest.raises(BundleError, match=rf"train\.json:{line}:\d+: not valid JSON"):
        run_bundle(bundle, logging_file=False)
    assert not trained(bundle)


def test_a_malformed_yaml_config_is_named_with_its_line_and_column(tmp_path, data):
    text = "max_epochs: 1\nnetwork:\n  _target_: UNet\n   spatial_dims: 3\n"
    bundle = write_bundle(tmp_path / "b", text, "train.yaml")
    with pytest.raises(BundleError, match=r"train\.yaml:4:\d+: not valid YAML"):
        run_bundle(bundle, logging_file=False)


def test_an_override_of_an_id_the_config_lacks_is_refused_with_the_nearest(tmp_path, data, capfd):
    bundle = write_bundle(tmp_path / "b", config(data))
    with pytest.raises(BundleError, match=r"'max_epoch'.*did you mean max_epochs\?.*--new-key max_epoch"):
        run_bundle(bundle, overrides={"max_epoch": 1}, logging_file=False)
    with pytest.raises(BundleError, match=r"'num_vall'.*did you mean num_val\?"):
        run_bundle(bundle, overrides={"num_vall": 1}, logging_file=False)
    # an argument of a component: its constructor names it
    with pytest.raises(BundleError, match=r"no such argument \(building SupervisedTrainer\): .*'max_epoch'"):
        run_bundle(bundle, overrides={"train#trainer#max_epoch": 1}, logging_file=False)
    assert not trained(bundle)
    # declared new, it is added as MONAI adds it; the ids the config has pass, in either separator
    result = run_bundle(
        bundle,
        overrides={"max_epoch": 1, "train::trainer::max_epochs": 1},
        new_keys=["max_epoch"],
        logging_file=False,
        fast=False,
        doctor=False,
    )
    assert trained(bundle) and result.run_dir.name.startswith("published-")
    assert "metadata" not in "".join(capfd.readouterr())  # no metadata.json: none read, no MONAI error line
    # text where the config holds a number: named before anything is built (MONAI would fail inside the run)
    with pytest.raises(
        BundleError, match=r"override max_epochs=two: the config \(train.json\) holds a int there \(1\)"
    ):
        run_bundle(bundle, overrides={"max_epochs": "two"}, logging_file=False)
    # a new id under a parent the config lacks: named, before anything is built
    with pytest.raises(
        BundleError, match=r"override 'extra#value' \(--new-key\): the config has no 'extra' to hold it"
    ):
        run_bundle(bundle, overrides={"extra#value": 1}, new_keys=["extra#value"], logging_file=False)


def test_the_command_line_refuses_a_misspelt_override_in_one_line_and_documents_new_key(tmp_path, data):
    bundle = write_bundle(tmp_path / "b", config(data))
    line = one_line(cli(bundle, "max_epoch=1"))
    assert line.startswith("monai-fast bundle run: override 'max_epoch'") and "max_epochs" in line
    assert not trained(bundle)
    help_text = subprocess.run(
        [sys.executable, "-m", "monai_fast", "bundle", "run", "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    assert "--new-key ID" in help_text and "--resume" in help_text
    assert one_line(cli(bundle, "--resume")).endswith("--resume continues the record in --run-dir: name that folder")
    r = cli(bundle, "--no-fast", "--new-key", "max_epoch", "max_epoch=1")  # declared new: it runs
    assert r.returncode == 0 and trained(bundle), r.stderr[-3000:]


def test_a_reference_to_an_id_the_config_does_not_define_is_named(tmp_path, data):
    cfg = config(data)
    cfg["loss_fn"] = cfg.pop("loss")  # the trainer still says @loss
    bundle = write_bundle(tmp_path / "b", cfg)
    with pytest.raises(BundleError, match=r"refers to @loss, which it does not define; did you mean @loss_fn\?"):
        run_bundle(bundle, logging_file=False)
    assert not trained(bundle)


def test_a_data_list_naming_a_missing_file_is_named(tmp_path, data):
    cfg = config(data)
    images = sorted(str(p) for p in (data / "imagesTr").glob("*.nii.gz"))
    missing = str(tmp_path / "gone" / "case_9.nii.gz")
    cfg["images"] = [missing, *images[1:]]
    cfg["train"]["dataset"]["_target_"] = "CacheDataset"  # loaded while the config builds, as the zoo's bundles do
    bundle = write_bundle(tmp_path / "b", cfg)
    with pytest.raises(BundleError, match=rf"{missing}: no such file \(building CacheDataset\)"):
        run_bundle(bundle, logging_file=False)
    assert not trained(bundle)


@pytest.mark.parametrize("cases", [0, 1])
def test_an_empty_or_too_small_dataset_dir_is_named(tmp_path, data, cases):
    folder = tmp_path / "few"
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True)
        for p in sorted((data / sub).glob("*.nii.gz"))[:cases]:
            shutil.copy(p, folder / sub / p.name)
    bundle = write_bundle(tmp_path / "b", config(data))
    with pytest.raises(BundleError, match=rf"data set of the config is empty .*dataset_dir {folder} holds no items"):
        run_bundle(bundle, overrides={"dataset_dir": str(folder)}, logging_file=False)
    assert not trained(bundle)


@pytest.mark.parametrize("variant", [[], ["--no-fast"]])
def test_volumes_smaller_than_the_patch_end_in_the_one_line(tmp_path, data, variant):
    bundle = write_bundle(tmp_path / "b", config(data))
    line = one_line(cli(bundle, *variant, "patch_size=[64,64,64]"))
    assert line.startswith("monai-fast bundle run: bad data: "), line
    assert "larger than the image size" in line and "RandCropByPosNegLabeld" in line
    if not variant:  # FastTraining's loader names the item's files
        assert "(image=" in line and "imagesTr/spleen_00" in line


def _unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare(), reason="needs a mount namespace (unshare -m, as root) for a read-only folder")
def test_a_read_only_bundle_folder_is_named_with_the_way_on(tmp_path, data):
    bundle = write_bundle(tmp_path / "b", config(data))
    ro = ("unshare", "-m", "sh", "-c", f'mount --bind -o ro "{bundle}" "{bundle}" && exec "$0" "$@"')
    line = one_line(cli(bundle, prefix=ro))
    assert f"cannot write {bundle}" in line and "bundle_root=<a writable folder>" in line, line
    elsewhere = tmp_path / "out"
    r = cli(bundle, f"bundle_root={elsewhere}", prefix=ro)
    assert r.returncode == 0, r.stderr[-3000:]
    assert any((elsewhere / "eval" / "monai_fast").iterdir())


def test_a_new_argument_of_a_component_passes_and_a_misspelt_one_is_named_by_its_constructor(tmp_path, data):
    """``network#dropout`` adds an argument ``UNet`` takes; ``network#dropuot`` is refused by ``UNet`` itself, in
    one line, before training: neither can be silently ignored, so neither needs ``--new-key``."""
    bundle = write_bundle(tmp_path / "b", config(data))
    with pytest.raises(BundleError, match=r"takes no such argument \(building UNet\): .*'dropuot'"):
        run_bundle(bundle, overrides={"network#dropuot": 0.1}, logging_file=False)
    assert not trained(bundle)
    result = run_bundle(bundle, overrides={"network#dropout": 0.1}, logging_file=False, fast=False, doctor=False)
    assert result.run_dir.name.startswith("published-")


def test_an_expression_that_is_not_python_is_named_before_anything_runs(tmp_path, data):
    cfg = config(data)
    cfg["run"] = ["$@train#trainer.run("]
    bundle = write_bundle(tmp_path / "b", cfg)
    with pytest.raises(BundleError, match=r"at run#0: \$@train#trainer\.run\( is not valid Python: '\(' was never"):
        run_bundle(bundle, logging_file=False)
    cfg["run"] = ["$@train#trainer.run()"]
    bundle = write_bundle(tmp_path / "b", cfg)
    with pytest.raises(BundleError, match=r"the override at device: \$torch\.device\('cpu' is not valid Python"):
        run_bundle(bundle, overrides={"device": "$torch.device('cpu'"}, logging_file=False)
    assert not trained(bundle)


def test_a_logging_file_that_cannot_be_applied_is_named(tmp_path, data):
    bundle = write_bundle(tmp_path / "b", config(data))
    conf = bundle / "configs" / "logging.conf"
    conf.write_text("[loggers]\nkeys=root\n")  # no [handlers], no [formatters]
    line = one_line(cli(bundle, "--logging_file", str(conf), logging_file=True))
    assert line == f"monai-fast bundle run: logging file {conf}: KeyError: 'formatters'", line


def test_an_engine_id_that_names_something_else_is_refused_before_attaching(tmp_path, data):
    bundle = write_bundle(tmp_path / "b", config(data))
    with pytest.raises(
        BundleError, match=r"'network' builds a UNet, not an engine: name the engine's id with --trainer-id"
    ):
        run_bundle(bundle, trainer_id="network", logging_file=False)
    with pytest.raises(BundleError, match=r"'loss' builds a DiceLoss, not an engine: .*--evaluator-id"):
        run_bundle(bundle, evaluator_id="loss", logging_file=False)
    with pytest.raises(BundleError, match=r"--trainer-id and --evaluator-id both name 'train#trainer'"):
        run_bundle(bundle, evaluator_id="train::trainer", logging_file=False)
    assert not trained(bundle)
    with pytest.raises(BundleError, match=r"is a file, not a folder"):
        run_bundle(bundle / "configs" / "train.json", logging_file=False)
