"""MONAI bundles with FastTraining: ``run_bundle`` / ``monai-fast bundle run`` and the config fragment.

Real parts: a bundle in the Model Zoo's layout written for these tests (``tests/bundles/seg3d``:
UNet, DiceCE, Novograd, ``CacheDataset`` + ``DataLoader(num_workers=2)``, ``amp: true``, the
zoo's handlers: ``ValidationHandler``, ``StatsHandler``, ``TensorBoardStatsHandler``,
``CheckpointSaver`` with the key metric, ``MetricsSaver``, a training ``Accuracy``), parsed by
MONAI's own ``ConfigWorkflow``, on synthetic NIfTI files; MONAI's own runner
(``python -m monai.bundle run``) for the fragment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bundle_parts import ROOT, bundle_cli, copy_bundle, monai_runner, small

from monai_fast.apps.sources.synthetic import generate_msd
from monai_fast.bundle import FRAGMENT, BundleError, bundle_config_files, parse_overrides, run_bundle, write_fragment
from monai_fast.report.applied import applied_levers
from monai_fast.telemetry.record import load_record


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_msd(tmp_path_factory.mktemp("bundle-data"), num_cases=4, shape=(48, 48, 32), progress=False)


@pytest.fixture
def bundle(tmp_path):
    return copy_bundle("seg3d", tmp_path)


def _outputs(bundle: Path) -> dict:
    return {
        "model": (bundle / "models" / "model.pt").is_file(),
        "metrics": (bundle / "eval" / "metrics.csv").is_file(),
        "tensorboard": any(p.name.startswith("events.out.tfevents") for p in (bundle / "eval").iterdir()),
    }


def test_run_bundle_attaches_fast_training_and_keeps_the_bundles_handlers(bundle, data):
    seen = {}
    result = run_bundle(bundle, overrides=small(data), on_applied=seen.update, logging_file=False)
    assert {"data", "precision"} <= set(seen) <= set(result.applied)  # shown before training; some settle while it runs
    assert {"data", "precision"} <= set(result.applied)
    # the bundle's own CacheDataset is kept: never a second cache
    assert result.applied["data"]["setting"] == "user cache", result.applied["data"]
    assert "already a CacheDataset: kept" in result.applied["data"]["reason"]
    assert result.run_dir.parent == bundle / "eval" / "monai_fast" and result.run_dir.name.startswith("fast-")
    assert _outputs(bundle) == {"model": True, "metrics": True, "tensorboard": True}
    rows, summary = load_record(result.run_dir)
    assert any(r.get("kind") == "epoch" for r in rows)
    assert result.verdict and result.verdict.startswith("verdict:")


def test_no_fast_runs_the_bundle_as_published_with_the_record(bundle, data):
    result = run_bundle(bundle, overrides=small(data), fast=False, logging_file=False)
    assert result.applied == {}
    assert _outputs(bundle) == {"model": True, "metrics": True, "tensorboard": True}
    rows, _ = load_record(result.run_dir)
    assert rows and not any(r.get("source") == "fast_training" for r in rows)


def test_the_fragment_makes_monais_own_runner_attach_fast_training(bundle, data):
    fragment = write_fragment(bundle / "configs" / "fast.json")
    assert json.loads(fragment.read_text()) == FRAGMENT
    files = [bundle / "configs" / "train.json", fragment]
    r = monai_runner(bundle, files, small(data), "--logging_file", str(bundle / "configs" / "logging.conf"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "FastTraining precision:" in r.stdout and "FastTraining data:" in r.stdout
    assert (r.stdout + r.stderr).count("FastTraining precision:") == 1  # printed, not also logged
    assert _outputs(bundle)["model"]
    (folder,) = (bundle / "eval" / "monai_fast").iterdir()  # a record folder of this run's own
    assert folder.name.startswith("fast-") and f"monai-fast run record: {folder}" in r.stdout
    _, summary = load_record(folder)
    assert summary  # FastTraining's decisions in the record


def test_the_command_line_runs_a_bundle_and_prints_each_decision_once(bundle, data):
    """With the bundle's own ``logging.conf`` (which shows ``monai_fast``'s INFO lines on the console), each
    decision taken at attach is shown once: printed, not also logged."""
    r = bundle_cli(bundle, small(data))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "FastTraining precision:" in r.stdout and "run record:" in r.stdout and "verdict:" in r.stdout
    both = r.stdout + r.stderr
    for lever in ("precision", "data", "validation data"):
        assert both.count(f"FastTraining {lever}:") == 1, both[-4000:]


def test_side_by_side_runs_get_records_of_their_own(bundle, data):
    """A fast run, the bundle as published next to it and the fast run again: three records, named by variant, each
    one segment; the published run's doctor names no lever FastTraining applied (it had none)."""
    fast = run_bundle(bundle, overrides=small(data), logging_file=False)
    published = run_bundle(bundle, overrides=small(data), fast=False, logging_file=False)
    again = run_bundle(bundle, overrides=small(data), logging_file=False, doctor=False)
    assert fast.run_dir.name.startswith("fast-") and again.run_dir.name.startswith("fast-")
    assert published.run_dir.name.startswith("published-")
    assert len({fast.run_dir, published.run_dir, again.run_dir}) == 3
    assert {p.parent for p in (fast.run_dir, published.run_dir)} == {bundle / "eval" / "monai_fast"}
    for run in (fast, published, again):
        rows, _ = load_record(run.run_dir)
        assert {r.get("segment", 0) for r in rows} == {0}
    rows, _ = load_record(published.run_dir)
    assert not any(r.get("source") == "fast_training" for r in rows)
    assert "already applied by FastTraining" not in published.verdict
    assert "segment" not in published.verdict.lower()  # no restart reported
    with pytest.raises(FileNotFoundError, match="holds the records of 3 runs, one per folder: fast-"):
        load_record(bundle / "eval" / "monai_fast")  # the doctor on the parent folder names the runs' folders


def test_a_record_folder_of_another_run_is_refused_unless_resumed(bundle, data):
    """An explicit run folder that holds a record is refused before any work; ``resume`` continues it, and the
    doctor of the continued record names only the levers of the run that continued it (here: none)."""
    folder = bundle / "my-record"
    run_bundle(bundle, overrides=small(data), logging_file=False, run_dir=folder, doctor=False)
    (bundle / "models" / "model.pt").unlink()
    with pytest.raises(BundleError, match="holds another run's record .*--resume"):
        run_bundle(bundle, overrides=small(data), fast=False, logging_file=False, run_dir=folder)
    assert not (bundle / "models" / "model.pt").exists()  # refused before training
    first, _ = load_record(folder)
    assert applied_levers(first)["precision"]["applied"]  # the first run had FastTraining
    resumed = run_bundle(bundle, overrides=small(data), fast=False, logging_file=False, run_dir=folder, resume=True)
    rows, _ = load_record(folder)
    assert {r.get("segment", 0) for r in rows} == {0, 1}
    assert applied_levers(rows) == {}  # the run that continued it had none
    assert "already applied by FastTraining" not in resumed.verdict


@pytest.mark.parametrize("fast", [True, False])
def test_a_bundle_that_ships_the_fragment_is_attached_once(bundle, data, fast):
    """``bundle run`` on a bundle whose configs merge the fragment: the fragment's ``attach_fast`` is left out, so
    one record of one segment, FastTraining attached once (and not at all for the published run)."""
    fragment = write_fragment(bundle / "configs" / "fast.json")
    files = [str(bundle / "configs" / "train.json"), str(fragment)]
    result = run_bundle(bundle, config_files=files, overrides=small(data), fast=fast, logging_file=False)
    assert list((bundle / "eval" / "monai_fast").iterdir()) == [result.run_dir]
    rows, _ = load_record(result.run_dir)
    assert {r.get("segment", 0) for r in rows} == {0}
    levers = [r["lever"] for r in rows if r.get("source") == "fast_training" and r.get("kind") == "event"]
    if fast:
        assert levers.count("precision") == 1, levers
    else:
        assert levers == []


def test_bad_bundles_are_named_before_training(bundle, tmp_path, data):
    with pytest.raises(BundleError, match="does not exist"):
        bundle_config_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="no train.json"):
        bundle_config_files(tmp_path / "empty")
    with pytest.raises(BundleError, match="extra.json not found"):
        bundle_config_files(bundle, "['configs/train.json','extra.json']")
    assert bundle_config_files(bundle, "['configs/train.json']") == [(bundle / "configs" / "train.json").resolve()]
    with pytest.raises(BundleError, match="'train#nope'"):
        run_bundle(bundle, overrides=small(data), trainer_id="train#nope", logging_file=False)
    with pytest.raises(BundleError, match="'validate#nope'"):
        run_bundle(bundle, overrides=small(data), evaluator_id="validate#nope", logging_file=False)
    assert not (bundle / "models").exists()  # nothing trained


def test_overrides_read_as_monai_bundle_reads_them():
    assert parse_overrides(
        ["--a#b", "2", "--c=[1, 2]", "d=true", "e=$torch.device('cpu')", "f=%x.json#k", "g=text"]
    ) == {"a#b": 2, "c": [1, 2], "d": True, "e": "$torch.device('cpu')", "f": "%x.json#k", "g": "text"}
    with pytest.raises(BundleError, match="has no value"):
        parse_overrides(["--a#b"])
    with pytest.raises(BundleError, match="cannot read override"):
        parse_overrides(["stray"])


def test_a_config_with_the_older_training_section_runs_it(bundle, data):
    """Some Model Zoo bundles name their run section ``training``: it runs when the config has no ``run``."""
    cfg = bundle / "configs" / "train.json"
    config = json.loads(cfg.read_text())
    config["training"] = config.pop("run")
    cfg.write_text(json.dumps(config))
    result = run_bundle(bundle, overrides=small(data), logging_file=False, doctor=False)
    assert (bundle / "models" / "model.pt").is_file()
    assert 0.0 <= result.metrics["validate/val_mean_dice"] <= 1.0 and "validate/best" in result.metrics
    assert "train/train_accuracy" in result.metrics
    config.pop("training")
    cfg.write_text(json.dumps(config))
    with pytest.raises(BundleError, match="no 'run' section to run \\(nor 'training'\\)"):
        run_bundle(bundle, overrides=small(data), logging_file=False)


def test_a_multi_gpu_bundle_runs_under_launch_with_fast_training_per_rank(bundle, data):
    """``multi_gpu_train.json`` merged over ``train.json``, 2 gloo ranks through ``monai-fast launch -m``."""
    ranks = {**small(data), "num_val": 2}  # MONAI's DistributedSampler needs an item per rank
    overrides = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in ranks.items() if k != "device"]
    configs = str([str(bundle / "configs" / "train.json"), str(bundle / "configs" / "multi_gpu_train.json")])
    cmd = [
        sys.executable,
        "-m",
        "monai_fast",
        "launch",
        "--nproc",
        "2",
        "--rdzv-timeout",
        "120",
        "-m",
        "monai_fast",
        "bundle",
        "run",
        str(bundle),
        "--config_file",
        configs,
        "--no-logging-file",
        *overrides,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    assert r.stdout.count("FastTraining precision:") == 2  # decided on each rank
    verdicts = [line for line in r.stdout.splitlines() if line.startswith("verdict:")]
    assert len(verdicts) == 1 and "stopped early" not in r.stdout  # rank 0, once every rank is done
    (folder,) = (bundle / "eval" / "monai_fast").iterdir()  # rank 0's folder, shared with rank 1
    records = sorted(p.name for p in folder.glob("record.rank*.jsonl"))
    assert records == ["record.rank0.jsonl", "record.rank1.jsonl"]
    assert _outputs(bundle)["model"]  # rank 0's CheckpointSaver


def test_a_bundle_with_monais_smartcache_and_its_handler_rotates_once_per_epoch(bundle, data, caplog):
    """A zoo-style config that caches with MONAI's ``SmartCacheDataset`` and rotates it with MONAI's
    ``SmartCacheHandler``: FastTraining keeps that data set (no second cache), its updater takes over from the
    handler, and each epoch trains on the window MONAI's rotation gives it (one step per epoch, not two)."""
    import logging

    more = data.parent / "smartcache-data"  # 6 training cases: a window of 2 that moves by 1 each epoch
    generate_msd(more, num_cases=7, shape=(32, 32, 24), progress=False)
    seen = bundle / "seen.txt"
    names = (  # the file of every image in a batch: a collated dict or a list of items
        "[Path(n).name for b in (e.state.batch if isinstance(e.state.batch, list) else [e.state.batch]) "
        "for n in monai.utils.ensure_tuple(b['image'].meta['filename_or_obj'])]"
    )
    log_batch = (
        "$@train#trainer.add_event_handler(ignite.engine.Events.ITERATION_COMPLETED, lambda e: open(@seen_file, 'a')"
        f".write(''.join(f'{{e.state.epoch}} {{n}}\\n' for n in {names})))"
    )
    smartcache = bundle / "configs" / "smartcache.json"
    smartcache.write_text(
        json.dumps(
            {
                "seen_file": str(seen),
                "+imports": ["$import ignite", "$import monai", "$from pathlib import Path"],
                "train#dataset": {
                    "_target_": "SmartCacheDataset",
                    "data": "$[{'image': i, 'label': l} for i, l in zip(@images[:-@num_val], @labels[:-@num_val])]",
                    "transform": "@train#preprocessing",
                    "cache_num": 2,
                    "replace_rate": 0.5,
                    "shuffle": False,
                    "num_init_workers": 1,
                    "num_replace_workers": 1,
                },
                "+train#handlers": [{"_target_": "SmartCacheHandler", "smartcacher": "@train#dataset"}],
                "+initialize": [log_batch],
            }
        )
    )
    overrides = {**small(more), "max_epochs": 3, "train#dataloader#num_workers": 0}
    files = [str(bundle / "configs" / "train.json"), str(smartcache)]
    with caplog.at_level(logging.INFO, logger="monai_fast"):
        result = run_bundle(bundle, config_files=files, overrides=overrides, logging_file=False)
    assert "smartcache" in json.dumps(result.applied["data"]).lower()  # the bundle's cache kept, named
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SmartCacheUpdater:")]
    assert any("SmartCacheHandler for this data set is removed" in line for line in lines), lines
    epochs: dict[int, set[str]] = {}
    for line in seen.read_text().split("\n"):
        if line:
            epoch, name = line.split()
            epochs.setdefault(int(epoch), set()).add(name)
    images = sorted(p.name for p in (more / "imagesTr").glob("*.nii.gz"))[:-1]
    assert epochs == {1: set(images[0:2]), 2: set(images[1:3]), 3: set(images[2:4])}


def test_a_bundle_whose_volumes_are_one_window_each_gets_no_sliding_window_advice(bundle, data):
    from monai_fast.report.doctor import doctor, prescribe

    # a window larger than any validation volume: the evaluator's sliding window is one window per volume
    overrides = {**small(data), "validate#inferer#roi_size": [64, 64, 64]}
    result = run_bundle(bundle, overrides=overrides, fast=False, logging_file=False)
    d = doctor(result.run_dir)
    assert d.numbers["in_effect"]["windows_per_volume"] == 1
    assert not any("sw_batch_size" in f or "sliding-window batch" in f for f in d.fixes), d.fixes
    lines = prescribe(load_record(result.run_dir)[0], d).splitlines()
    code = lines[next((i for i, ln in enumerate(lines) if ln.startswith("# code changes")), len(lines)) :]
    assert not any("FastTraining(" in ln for ln in code), lines


def test_bundle_fragment_writes_without_loading_torch_and_quietly(tmp_path):
    """``bundle fragment`` writes 8 lines: it loads neither torch nor MONAI and pins no OpenMP threads."""
    out = tmp_path / "configs" / "fast.json"
    code = (
        "import sys; from monai_fast.__main__ import main; rc = main(['bundle', 'fragment', '--out', sys.argv[1]]); "
        "print('loaded:', sorted({'torch', 'monai'} & set(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "loaded: []" in r.stdout and "OpenMP" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert json.loads(out.read_text()) == FRAGMENT


def test_the_command_prints_its_version():
    from monai_fast import __version__

    r = subprocess.run([sys.executable, "-m", "monai_fast", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == f"monai-fast {__version__}", r.stdout + r.stderr


def test_the_fragments_attach_fast_is_the_one_attach_path_fast_or_published(tmp_path, capsys):
    """``attach_fast`` (what MONAI's runner calls through the fragment, and ``bundle run`` too) on real MONAI engines:
    with ``fast=False`` the bundle as published gets the same record and timers, in a ``published-`` folder of its
    own, and no FastTraining; with ``fast=True`` FastTraining comes on top, its decisions printed once."""
    import torch
    from monai.engines import SupervisedEvaluator, SupervisedTrainer

    from monai_fast.bundle import attach_fast
    from monai_fast.handlers import FastTraining, InferenceSplit, RecordHandler, TimeBreakdown, TrainingAlgorithmTime
    from monai_fast.handlers.lifecycle import handlers_on

    def engines() -> tuple:
        net = torch.nn.Conv2d(1, 2, 3, padding=1)
        data = [{"image": torch.randn(1, 1, 8, 8), "label": torch.randint(0, 2, (1, 1, 8, 8))} for _ in range(2)]
        evaluator = SupervisedEvaluator(device="cpu", val_data_loader=data, network=net)
        trainer = SupervisedTrainer(
            device="cpu",
            max_epochs=1,
            train_data_loader=data,
            network=net,
            optimizer=torch.optim.SGD(net.parameters(), 0.1),
            loss_function=lambda pred, label: torch.nn.functional.cross_entropy(pred, label[:, 0].long()),
        )
        return trainer, evaluator

    trainer, evaluator = engines()
    assert attach_fast(trainer, evaluator, records_dir=tmp_path, fast=False) is None
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("published-") and f"monai-fast run record: {folder}" in capsys.readouterr().out
    assert {RecordHandler, TimeBreakdown, TrainingAlgorithmTime} <= set(handlers_on(trainer))
    assert FastTraining not in handlers_on(trainer)
    assert {RecordHandler, InferenceSplit} <= set(handlers_on(evaluator))
    trainer.run()
    rows, _ = load_record(folder)
    assert any(r.get("kind") == "epoch" for r in rows) and not any(r.get("source") == "fast_training" for r in rows)

    trainer, evaluator = engines()
    fast = attach_fast(trainer, evaluator, records_dir=tmp_path / "fast", precision="fp32")
    assert isinstance(fast, FastTraining) and handlers_on(trainer)[FastTraining] is fast
    assert {RecordHandler, TimeBreakdown, TrainingAlgorithmTime} <= set(handlers_on(trainer))
    assert InferenceSplit in handlers_on(evaluator)
    assert capsys.readouterr().out.count("FastTraining precision:") == 1
