"""``tune_bundle``: the tuner measures a bundle's batch sizes and writes an override the bundle reads.

Real parts: the Model-Zoo-layout test bundle (``tests/bundles/seg3d``) parsed by MONAI's
``ConfigParser``, its network, loss and optimizer timed for real on synthetic NIfTI files, and the
written ``tuned.json`` merged by MONAI's ``ConfigWorkflow`` as a bundle user merges it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bundle_parts import ROOT, copy_bundle

from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.bundle import BundleError
from monai_fast.bundle.pieces import ZOO_KEYS
from monai_fast.bundle.tune import tune_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    base = tmp_path_factory.mktemp("tune-bundle")
    data = generate_msd(base / "data", num_cases=3, shape=(40, 40, 32), progress=False)
    dst = copy_bundle("seg3d", base)
    overrides = {
        "dataset_dir": str(data),
        "num_val": 1,
        "patch_size": [16, 16, 16],
        "network_def#channels": [4, 8],
        "network_def#strides": [2],
        "network_def#num_res_units": 0,
        "device": "$torch.device('cpu')",
    }
    return dst, overrides


def test_tuned_json_names_the_zoo_keys_and_the_bundle_reads_it(bundle):
    from monai.bundle import ConfigWorkflow

    root, overrides = bundle
    tuned = tune_bundle(
        root, overrides=overrides, batch_range=(1, 2), sw_batch_range=(1, 2), warmup=0, min_iters=1, min_time_s=0.0
    )
    written = json.loads(tuned.path.read_text())
    assert tuned.path == root / "configs" / "tuned.json" and written == tuned.overrides and tuned.layout == "zoo"
    assert written[ZOO_KEYS["batch"]] in (1, 2) and written[ZOO_KEYS["sw_batch"]] in (1, 2)
    assert ZOO_KEYS["val_device"] not in written  # a CPU run stitches where it computes
    trials = tuned.result["trials"]
    assert {t["phase"] for t in trials} == {"train", "val"}
    # the patch and crops per volume come from the bundle's own chain (RandCropByPosNegLabeld: 16^3, 2 crops)
    assert "patch=16x16x16" in tuned.result["key"] and "samples=2" in tuned.result["key"]
    workflow = ConfigWorkflow(
        config_file=[str(root / "configs" / "train.json"), str(tuned.path)],
        logging_file=False,
        meta_file=str(root / "configs" / "metadata.json"),
        bundle_root=str(root),
        **overrides,
    )
    workflow.initialize()
    assert workflow.parser.get_parsed_content("train#dataloader").batch_size == written[ZOO_KEYS["batch"]]
    assert workflow.parser.get_parsed_content("validate#inferer").sw_batch_size == written[ZOO_KEYS["sw_batch"]]


def test_a_bundle_without_a_3d_sliding_window_is_refused_by_name(bundle, tmp_path):
    root, overrides = bundle
    with pytest.raises(BundleError, match="validate#inferer is not a 3-D sliding window"):
        tune_bundle(
            root, overrides={**overrides, "validate#inferer": {"_target_": "SimpleInferer"}}, out=tmp_path / "t.json"
        )
    assert not (tmp_path / "t.json").exists()


def test_monai_fast_tune_bundle_reports_as_it_goes_and_suggests_the_run_that_trains_as_tuned(bundle, tmp_path):
    import shlex
    import subprocess
    import sys

    root, overrides = bundle
    given = {**overrides, "validate#inferer#sw_batch_size": 1, "max_epochs": 1}
    sets = []
    for key, value in given.items():
        sets += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    out = tmp_path / "tuned.json"
    limits = ["--batch-range", "1", "2", "--sw-range", "1", "2", "--trials", "1", "--precision", "bf16"]
    r = subprocess.run(
        [sys.executable, "-m", "monai_fast", "tune", "--bundle", str(root), "--bundle-out", str(out), *limits, *sets],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    written = json.loads(out.read_text())
    assert set(written) >= {ZOO_KEYS["batch"], ZOO_KEYS["sw_batch"]}
    lines = r.stdout.splitlines()
    # the plan comes first, with a bound on the trials, then one line per trial as it ends, then the table
    plan = next(i for i, line in enumerate(lines) if "at most" in line and "trials" in line)
    most = int(lines[plan].split("at most ")[1].split(" trials")[0])
    trials = [i for i, line in enumerate(lines) if line.startswith("trial ")]
    assert trials and plan < trials[0] and len(trials) <= most, r.stdout
    assert all(f"/{most}: " in lines[i] for i in trials)
    table = next(i for i, line in enumerate(lines) if line.startswith("phase "))
    assert trials[-1] < table
    # the trials ran in the precision asked for the run (the tuner measured fp32 whatever the run used)
    assert all("(bf16" in lines[i] for i in trials), r.stdout
    assert f"{ZOO_KEYS['batch']} = {written[ZOO_KEYS['batch']]}" in r.stdout and str(out) in r.stdout
    # the suggested command keeps the overrides the sizes were measured with, less the keys tuned.json sets
    command = lines[-1].strip()
    assert command.startswith("monai-fast bundle run ") and "--precision bf16" in command
    words = shlex.split(command)
    assert "patch_size=[16, 16, 16]" in words and "max_epochs=1" in words
    assert not any(w.startswith(ZOO_KEYS["sw_batch"]) for w in words)
    run = subprocess.run(
        [sys.executable, "-m", "monai_fast", *words[1:]], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"batch_size={written[ZOO_KEYS['batch']]}," in run.stdout  # FastTraining's loader line: the tuned batch
    assert "FastTraining precision: bf16" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "monai_fast", "tune", "--bundle", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert bad.returncode != 0 and "nope does not exist" in bad.stderr and "Traceback" not in bad.stderr


FAST = {"warmup": 0, "min_iters": 1, "min_time_s": 0.0}


def _copy(root: Path, dst: Path, **train_edits) -> Path:
    """A copy of the test bundle with top-level sections of train.json replaced (``section={...}``)."""
    shutil.copytree(root, dst, ignore=shutil.ignore_patterns("tuned.json"))
    train = dst / "configs" / "train.json"
    config = json.loads(train.read_text())
    for section, edits in train_edits.items():
        config[section].update(edits)
    train.write_text(json.dumps(config))
    return dst


def test_the_batch_is_capped_by_the_training_set_so_a_drop_last_bundle_still_trains(bundle, tmp_path):
    from monai.bundle import ConfigWorkflow

    root, overrides = bundle
    lines: list[str] = []
    # 3 volumes, 1 validates: 2 train; drop_last with a batch above 2 trains no iteration at all
    overrides = {**overrides, "train#dataloader#drop_last": True, "max_epochs": 1}
    tuned = tune_bundle(
        root,
        overrides=overrides,
        out=tmp_path / "t.json",
        batch_range=(4, 8),
        sw_batch_range=(1, 1),
        say=lines.append,
        **FAST,
    )
    assert tuned.overrides[ZOO_KEYS["batch"]] == 2
    assert any("capped at 2" in line and "drop_last" in line for line in lines), lines
    workflow = ConfigWorkflow(
        config_file=[str(root / "configs" / "train.json"), str(tuned.path)],
        logging_file=False,
        bundle_root=str(root),
        **overrides,
    )
    workflow.initialize()
    trainer = workflow.parser.get_parsed_content("train#trainer")
    trainer.run()
    assert trainer.state.iteration == 1  # one batch of both volumes: the epoch trained


def test_a_key_inside_a_dollar_expression_is_named_not_written_and_the_bundle_still_reads(bundle, tmp_path):
    from monai.bundle import ConfigWorkflow

    root, overrides = bundle
    built = _copy(
        root,
        tmp_path / "built",
        train={"dataloader": "$monai.data.DataLoader(@train#dataset, batch_size=2, shuffle=True, num_workers=0)"},
    )
    lines: list[str] = []
    tuned = tune_bundle(built, overrides=overrides, batch_range=(1, 2), sw_batch_range=(1, 2), say=lines.append, **FAST)
    batch = ZOO_KEYS["batch"]
    assert batch not in json.loads(tuned.path.read_text()) and ZOO_KEYS["sw_batch"] in tuned.overrides
    why = tuned.not_written[batch]
    assert "train#dataloader is a $ expression" in why and "yourself" in why
    assert any(line.startswith(f"{batch} will not be written") for line in lines[:3]), lines  # said up front
    # the training set is still counted from train#dataset#data: 2 volumes cap the batch
    assert tuned.result["key"].count("batch=1-2") == 1
    workflow = ConfigWorkflow(
        config_file=[str(built / "configs" / "train.json"), str(tuned.path)],
        logging_file=False,
        bundle_root=str(built),
        **overrides,
    )
    workflow.initialize()  # the merge the old override file broke
    assert workflow.parser.get_parsed_content("validate#inferer").sw_batch_size == tuned.overrides[ZOO_KEYS["sw_batch"]]
    # nothing can be written: refused before any trial, no file
    neither = _copy(
        built,
        tmp_path / "neither",
        validate={"inferer": "$monai.inferers.SlidingWindowInferer(roi_size=@patch_size, sw_batch_size=4)"},
    )
    lines.clear()
    with pytest.raises(BundleError, match="none of the tuned keys can be merged"):
        tune_bundle(neither, overrides=overrides, say=lines.append, **FAST)
    assert not (neither / "configs" / "tuned.json").exists() and not any(line.startswith("trial") for line in lines)


def test_an_override_file_that_cannot_be_written_fails_before_any_trial(bundle, tmp_path, tmpfs):
    import os
    import subprocess

    root, overrides = bundle
    if os.geteuid() == 0:  # root writes through folder permissions: a read-only file system instead
        where = tmpfs("size=1M", "ro")
        copied = _copy(root, where / "seg3d")
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
    else:
        copied = _copy(root, tmp_path / "seg3d")
        (copied / "configs").chmod(0o500)
    lines: list[str] = []
    try:
        with pytest.raises(BundleError, match=r"cannot write the override file .*tuned\.json.*--bundle-out"):
            tune_bundle(copied, overrides=overrides, say=lines.append, **FAST)
    finally:
        if os.geteuid() != 0:
            (copied / "configs").chmod(0o700)
    assert lines == []  # not even the config was read


def test_a_misspelt_nested_override_is_named_with_the_nearest_id_before_any_trial(bundle):
    root, overrides = bundle
    lines: list[str] = []
    with pytest.raises(BundleError, match=r"override 'train#dataloadr#batch_size'.*did you mean train#dataloader"):
        tune_bundle(root, overrides={**overrides, "train#dataloadr#batch_size": 1}, say=lines.append, **FAST)
    assert not any("trial" in line for line in lines)


def test_a_folder_with_neither_layout_says_what_is_missing_and_what_works(tmp_path):
    (tmp_path / "work" / "configs").mkdir(parents=True)
    (tmp_path / "work" / "configs" / "network.yaml").write_text("network: {}\n")
    algo = tmp_path / "work" / "segresnet_0" / "configs"
    algo.mkdir(parents=True)
    (algo / "hyper_parameters.yaml").write_text("num_images_per_batch: 1\n")
    with pytest.raises(BundleError) as info:
        tune_bundle(tmp_path / "work")
    message = str(info.value)
    assert "no train.json or train.yaml" in message and "hyper_parameters.yaml" in message
    assert "--bundle-config" in message and "--config_file" not in message
    assert str(tmp_path / "work" / "segresnet_0") in message  # the algorithm folder Auto3DSeg made inside


def test_tune_bundle_refuses_the_recipe_options_in_one_line(bundle):
    from monai_fast.apps.cli import main

    root, _ = bundle
    with pytest.raises(SystemExit, match="--patch-size, --out: not used with --bundle .*--set ID=VALUE"):
        main(["tune", "--bundle", str(root), "--patch-size", "8", "8", "8", "--out", "x.json"])
    with pytest.raises(SystemExit, match=r"tune --bundle: batch_range must be \(low, high\) with 1 <= low <= high"):
        main(["tune", "--bundle", str(root), "--batch-range", "4", "2"])


@pytest.fixture(scope="module")
def algo(tmp_path_factory):
    """The Auto3DSeg-layout algorithm folder over 3 synthetic volumes (1 x 1 x 2 mm), its data list in Auto3DSeg's
    form (a ``fold`` per training item)."""
    base = tmp_path_factory.mktemp("tune-algo")
    data = generate_msd(base / "data", num_cases=3, shape=(40, 40, 32), spacing=(1.0, 1.0, 2.0), progress=False)
    items = json.loads((data / "dataset.json").read_text())["training"]
    datalist = base / "datalist.json"
    datalist.write_text(json.dumps({"training": [{**item, "fold": i % 3} for i, item in enumerate(items)]}))
    dst = copy_bundle("auto3dseg_algo", base).rename(base / "segresnet_0")  # the name Auto3DSeg gives it
    return dst, {"data_list_file_path": str(datalist), "data_file_base_dir": str(data)}


def test_an_auto3dseg_algorithm_gets_its_training_keys_and_reads_them_as_auto3dseg_passes_its_configs(algo):
    from monai.bundle import ConfigParser

    from monai_fast.bundle.pieces import AUTO3DSEG_KEYS, auto3dseg_config_files

    root, overrides = algo
    (root / "configs" / "tuned.json").write_text(json.dumps({"training#num_images_per_batch": 99}))  # an old one
    tuned = tune_bundle(
        root, overrides=overrides, batch_range=(1, 2), sw_batch_range=(1, 3), warmup=0, min_iters=1, min_time_s=0.0
    )
    assert tuned.layout == "auto3dseg" and tuned.path == root / "configs" / "tuned.json"
    # every config file of configs/ in name order, less the override being rewritten
    assert [f.name for f in tuned.config_files] == ["hyper_parameters.yaml", "network.yaml", "transforms_validate.yaml"]
    written = json.loads(tuned.path.read_text())
    batch, sw = "training#" + AUTO3DSEG_KEYS["batch"], "training#" + AUTO3DSEG_KEYS["sw_batch"]
    assert set(written) == {batch, sw}  # on a CPU the volume stays where it is computed: no sw_input_on_cpu
    assert written[batch] in (1, 2) and written[sw] in (1, 2, 3)
    key = tuned.result["key"]
    assert "patch=16x16x16" in key and "samples=2" in key  # training#roi_size, num_patches_per_image
    # the fold-0 validation image (40 x 40 x 32 at 1 x 1 x 2 mm) resampled to 2 mm: 20 x 20 x 32
    assert "val=20x20x32" in key, key
    # Auto3DSeg hands the training script every file of configs/ in name order: tuned.json comes last and wins
    parser = ConfigParser()
    parser.read_config([str(f) for f in auto3dseg_config_files(root)])
    assert parser[batch] == written[batch] and parser[sw] == written[sw]
    assert parser["training#roi_size"] == [16, 16, 16]  # the rest of the algorithm as it was


def test_an_auto3dseg_algorithm_with_its_keys_at_the_top_deep_supervision_and_a_missing_one_named(algo, tmp_path):
    root, overrides = algo
    flat = tmp_path / "flat"
    shutil.copytree(root, flat)
    (flat / "configs" / "tuned.json").unlink(missing_ok=True)
    (flat / "configs" / "hyper_parameters.yaml").write_text(
        "input_channels: 1\noutput_classes: null\nroi_size: [16, 16, 16]\nnum_images_per_batch: 1\n"
        "num_crops_per_image: 1\namp: false\n"
        "loss: {_target_: DiceCELoss, to_onehot_y: true, softmax: true}\n"
        "optimizer: {_target_: torch.optim.SGD, lr: 0.01}\n"
    )
    # segresnet's network: one output per depth while training (deep supervision), its labels resized per depth
    (flat / "configs" / "network.yaml").write_text(
        "network: {_target_: SegResNetDS, init_filters: 4, blocks_down: [1, 1, 1], dsdepth: 3,"
        " in_channels: '@input_channels', out_channels: '@output_classes'}\n"
    )
    with pytest.raises(BundleError, match="output_classes is not set"):
        tune_bundle(flat, overrides=overrides, out=tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()
    tuned = tune_bundle(
        flat,
        overrides={**overrides, "output_classes": 2},
        batch_range=(1, 2),
        sw_batch_range=(1, 2),
        warmup=0,
        min_iters=1,
        min_time_s=0.0,
    )
    # a template without a sliding-window batch key gets the training batch only, at the top
    assert set(json.loads(tuned.path.read_text())) == {"num_images_per_batch"}
    assert "SegResNetDS" in tuned.result["key"]
    assert "patch=16x16x16" in tuned.result["key"]


def test_a_misspelt_override_is_refused_before_tuning(bundle, tmp_path):
    """``--set patch_sise=[32,32,32]`` for ``patch_size``: named with the nearest id, nothing measured or written."""
    root, overrides = bundle
    with pytest.raises(BundleError, match=r"'patch_sise'.*did you mean patch_size"):
        tune_bundle(root, overrides={**overrides, "patch_sise": [32, 32, 32]}, out=tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()
