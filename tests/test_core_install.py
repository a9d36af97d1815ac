"""The core install alone runs FastTraining; a missing extra is one line naming it.

The environment with the core alone is real: a folder holding only the installed distributions
that monai-fast's core requirements pull in (their closure, read from the installed metadata), run
by ``python -S -E`` so no site-packages and no ``PYTHONPATH`` are seen. The extras' packages
(matplotlib, tensorboard, s3fs, tifffile, onnx, nvtx, nvidia-ml-py, nbclient) are simply not there.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from monai_fast.extras import EXTRAS, MissingExtraError, available, require

ROOT = Path(__file__).resolve().parents[1]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _core_closure() -> dict[str, md.Distribution]:
    """Installed distributions that the core requirements need, recursively, extras left out."""
    todo = [r for r in md.requires("monai-fast") or [] if "extra ==" not in r]
    found: dict[str, md.Distribution] = {}
    while todo:
        req = todo.pop()
        marker = req.split(";", 1)[1] if ";" in req else ""
        if "extra ==" in marker:
            continue
        if marker and ("sys_platform" in marker or "platform_system" in marker or "python_version" in marker):
            try:
                from packaging.markers import Marker

                if not Marker(marker.strip()).evaluate():
                    continue
            except Exception:  # noqa: BLE001 - an unreadable marker: take the requirement
                pass
        name = _norm(_NAME.match(req.strip()).group(0))
        if name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional platform package (nvidia-* wheels of a CUDA torch, say)
        found[name] = dist
        todo += [r for r in dist.requires or []]
    return found


def _core_site(tmp_path: Path) -> Path:
    site = tmp_path / "core-site"
    site.mkdir()
    for dist in _core_closure().values():
        base = Path(dist.locate_file(""))
        for entry in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            src, dst = base / entry, site / entry
            if src.exists() and not dst.exists() and entry != "__pycache__" and not entry.endswith(".pth"):
                dst.symlink_to(src)
    return site


def _run_core(site: Path, code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    boot = f"import sys; sys.path[:0] = [{str(site)!r}, {str(ROOT)!r}]\n"
    return subprocess.run(
        [sys.executable, "-S", "-E", "-c", boot + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def core_site(tmp_path_factory):
    return _core_site(tmp_path_factory.mktemp("core"))


def test_the_core_closure_leaves_the_extras_out():
    names = set(_core_closure())
    assert {"torch", "monai", "pytorch-ignite", "numpy", "nibabel"} <= names
    for extra, dists in EXTRAS.items():
        assert not set(map(_norm, dists)) & names, f"{extra} extra pulled in by the core: {set(dists) & names}"


def test_fast_training_attaches_and_runs_with_the_core_alone(core_site):
    code = """
        import importlib.util
        for mod in ("matplotlib", "tensorboard", "s3fs", "tifffile", "onnxruntime", "nvtx", "pynvml", "nbclient"):
            assert importlib.util.find_spec(mod) is None, mod + " is visible in the core-only environment"
        import numpy as np, torch
        from monai.data import DataLoader, Dataset
        from monai.engines import SupervisedEvaluator, SupervisedTrainer
        from monai.handlers import MeanDice, ValidationHandler
        from monai.inferers import SimpleInferer, SlidingWindowInferer
        from monai.losses import DiceLoss
        from monai.networks.nets import UNet
        from monai.transforms import AsDiscreted, Compose, EnsureChannelFirstd, RandSpatialCropd, ScaleIntensityd
        from monai_fast import FastTraining

        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        items = [{"image": rng.random((16, 16, 16), dtype=np.float32),
                  "label": (rng.random((16, 16, 16)) > 0.5).astype(np.float32)} for _ in range(4)]
        det = [EnsureChannelFirstd(keys=["image", "label"], channel_dim="no_channel"), ScaleIntensityd(keys="image")]
        crop = RandSpatialCropd(keys=["image", "label"], roi_size=(8, 8, 8), random_size=False)
        net = UNet(3, 1, 2, (4, 8), (2,), num_res_units=0)
        post = Compose([AsDiscreted(keys="pred", argmax=True, to_onehot=2), AsDiscreted(keys="label", to_onehot=2)])
        dice = MeanDice(include_background=False,
                        output_transform=lambda x: ([o["pred"] for o in x], [o["label"] for o in x]))
        evaluator = SupervisedEvaluator(device=torch.device("cpu"), network=net, postprocessing=post,
                                        val_data_loader=DataLoader(Dataset(items[:2], Compose(det)), batch_size=1),
                                        inferer=SlidingWindowInferer((8, 8, 8)), key_val_metric={"dice": dice})
        trainer = SupervisedTrainer(device=torch.device("cpu"), max_epochs=2, network=net,
                                    train_data_loader=DataLoader(Dataset(items, Compose(det + [crop])), batch_size=2),
                                    optimizer=torch.optim.Adam(net.parameters(), 1e-3), inferer=SimpleInferer(),
                                    loss_function=DiceLoss(to_onehot_y=True, softmax=True),
                                    train_handlers=[ValidationHandler(1, evaluator)])
        fast = FastTraining()
        fast.attach(trainer, evaluator)
        trainer.run()
        assert trainer.state.epoch == 2 and "dice" in evaluator.state.metrics
        print("OK", sorted(fast.applied))
    """
    r = _run_core(core_site, code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_a_missing_extra_is_one_line_naming_it(core_site):
    code = """
        from monai_fast.extras import MissingExtraError, require
        try:
            require("matplotlib.pyplot", extra="plots", feature="the doctor's PNGs")
        except MissingExtraError as err:
            print("MSG", err)
    """
    r = _run_core(core_site, code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        'MSG the doctor\'s PNGs needs matplotlib.pyplot, which is not installed: pip install "monai-fast[plots]"'
        in r.stdout
    )


def test_require_returns_an_installed_module_and_refuses_unknown_extras():
    assert require("json", extra="plots", feature="x").dumps([1]) == "[1]"
    with pytest.raises(ValueError, match="unknown extra"):
        require("json", extra="nope", feature="x")
    with pytest.raises(MissingExtraError, match=r"monai-fast\[wsi\]") as info:
        require("a_module_that_is_not_there", extra="wsi", feature="reading slides")
    assert isinstance(info.value, ImportError) and info.value.extra == "wsi"
    assert available("json") and not available("a_module_that_is_not_there") and not available("json.nope.x")


def test_an_installed_but_broken_module_is_not_called_a_missing_extra(tmp_path, monkeypatch):
    (tmp_path / "a_broken_slide_reader").mkdir()
    (tmp_path / "a_broken_slide_reader" / "__init__.py").write_text("raise RuntimeError('its own init fails')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:  # MONAI's OptionalImportError, with the import's own error
        require("a_broken_slide_reader", extra="wsi", feature="reading slides")
    assert not isinstance(info.value, MissingExtraError) and "its own init fails" in str(info.value)


def test_setup_cfg_extras_match_the_code():
    text = (ROOT / "setup.cfg").read_text()

    def listed(extra: str) -> set[str]:
        block = re.search(rf"^{extra} =\n((?:    .+\n)+)", text, re.MULTILINE)
        assert block, f"setup.cfg has no [{extra}] extra"
        return {_norm(_NAME.match(line.strip()).group(0)) for line in block.group(1).splitlines()}

    for extra, dists in EXTRAS.items():
        assert set(map(_norm, dists)) <= listed(extra), (extra, dists, listed(extra))
        for whole in ("all", "dev"):  # spelled out (a self-referencing extra sends pip's resolver far back)
            assert set(map(_norm, dists)) <= listed(whole), (whole, extra)


def _lines_naming(text: str, extra: str) -> list[str]:
    return [line for line in text.splitlines() if f'pip install "monai-fast[{extra}]"' in line]


def test_s3_and_wsi_without_their_extras_are_one_line_each_before_any_connection(core_site, tmp_path):
    slide = tmp_path / "slide.tif"
    slide.write_bytes(b"II*\x00" + bytes(60))  # a TIFF header: the preflight needs tifffile to read on
    code = f"""
        import socket
        def no_network(*args, **kwargs):
            raise AssertionError("a connection was tried")
        socket.socket.connect = socket.socket.connect_ex = socket.getaddrinfo = socket.create_connection = no_network

        from monai_fast.apps.cli import main
        from monai_fast.apps.sources.msd import load_msd_datalist
        from monai_fast.data.preflight import preflight_wsi
        from monai_fast.apps.sources.remote import is_url, localize, read_remote_text
        from monai_fast.apps.sources.wsi import generate_wsi
        from monai_fast.apps.sources.wsi_reader import WSIBackendError, choose_wsi_backend
        from monai_fast.extras import MissingExtraError

        assert is_url("s3://bucket/x")
        calls = {{
            "localize": lambda: localize([{{"image": "/local/a.nii.gz", "label": "s3://bucket/x/a_seg.nii.gz"}}],
                                         cache_dir={str(tmp_path / "cache")!r}),
            "read_remote_text": lambda: read_remote_text("s3://bucket/x/dataset.json"),
            "load_msd_datalist": lambda: load_msd_datalist("s3://bucket/x"),
            "preflight_wsi": lambda: preflight_wsi([{{"image": {str(slide)!r}, "location": [4, 4]}}], patch_size=8,
                                                   cache=False),
            "generate_wsi": lambda: generate_wsi({str(tmp_path / "wsi")!r}, num_slides=2, size=(128, 128), tile=16,
                                                 patch_size=16, progress=False),
        }}
        for name, call in calls.items():
            try:
                call()
            except MissingExtraError as err:
                print(name, "|", type(err).__name__, "|", err)
            else:
                print(name, "| no error")
        try:
            choose_wsi_backend("auto")
        except WSIBackendError as err:
            print("choose_wsi_backend |", err)
        try:
            main(["synth", {str(tmp_path / "synth")!r}, "--kind", "wsi", "--no-progress"])
        except SystemExit as stop:
            print("cli |", stop)
    """
    r = _run_core(core_site, code)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = dict(line.split(" | ", 1) for line in r.stdout.splitlines() if " | " in line)
    s3 = 'MissingExtraError | reading {} needs s3fs, which is not installed: pip install "monai-fast[s3]"'
    assert out["localize"] == s3.format("s3://bucket/x/a_seg.nii.gz"), r.stdout
    assert out["read_remote_text"] == s3.format("s3://bucket/x/dataset.json"), r.stdout
    assert out["load_msd_datalist"] == s3.format("s3://bucket/x/dataset.json"), r.stdout
    wsi = 'needs tifffile, which is not installed: pip install "monai-fast[wsi]"'
    assert out["preflight_wsi"] == f"MissingExtraError | reading the slide {slide} {wsi}", r.stdout
    assert out["generate_wsi"] == f"MissingExtraError | writing synthetic whole-slide images {wsi}", r.stdout
    assert not (tmp_path / "wsi").exists()  # refused before anything is written
    assert 'not tifffile: tifffile not installed (pip install "monai-fast[wsi]")' in out["choose_wsi_backend"]
    assert out["cli"] == f"monai-fast synth: writing synthetic whole-slide images {wsi}", r.stdout
    assert "Traceback" not in r.stderr and "fsspec" not in r.stdout + r.stderr, r.stderr[-2000:]


def test_the_onnx_backend_without_its_extra_names_it(core_site):
    code = """
        import torch
        from monai_fast.apps.inference.backends import BackendUnavailable, available, build_predictor

        print("available |", available("cpu")["onnx"])
        try:
            build_predictor(torch.nn.Conv3d(1, 2, 3, padding=1), "onnx", roi_size=(8, 8, 8), sw_batch_size=1)
        except BackendUnavailable as err:
            print("build |", err)
    """
    r = _run_core(core_site, code)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = dict(line.split(" | ", 1) for line in r.stdout.splitlines() if " | " in line)
    needs = 'the Python package(s) onnx, onnxruntime, onnxscript (pip install "monai-fast[onnx]")'
    assert out["available"] == needs, r.stdout
    assert out["build"] == f"backend 'onnx' is not available here: it needs {needs}", r.stdout


def test_the_doctor_writes_its_text_report_without_matplotlib_and_warns_once(core_site, tmp_path):
    code = f"""
        import logging, time
        from pathlib import Path
        from ignite.engine import Engine
        from monai_fast.apps.cli import main
        from monai_fast.handlers import GPUSampler, RecordHandler, TimeBreakdown
        from monai_fast.report.doctor import doctor
        from monai_fast.telemetry.nvml import FakeNvml

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        for name in ("a", "b"):
            run = Path({str(tmp_path)!r}) / name
            engine = Engine(lambda e, b: time.sleep(0.005))
            RecordHandler(run).attach(engine)
            TimeBreakdown().attach(engine)
            GPUSampler(interval_s=0.01, backend=FakeNvml(util=[20.0, 30.0], mem_total_mib=80000)).attach(engine)
            engine.run(list(range(8)), max_epochs=2)
            d = doctor(run)
            print("verdict |", name, d.verdict, d.report)
        print("cli |", main(["doctor", str(Path({str(tmp_path)!r}) / "a")]))
    """
    r = _run_core(core_site, code)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for name in ("a", "b"):
        run = tmp_path / name
        report = (run / "report.md").read_text()
        assert "**Verdict:" in report and "| epoch |" in report, report
        assert "![" not in report and not list(run.glob("*.png")), report
        assert report.rstrip().endswith(
            'No pictures: they need matplotlib, which is not installed (pip install "monai-fast[plots]").'
        )
        assert (run / "doctor.json").is_file()
    assert "cli | 0" in r.stdout and "report: " + str(tmp_path / "a" / "report.md") in r.stdout, r.stdout
    warnings = _lines_naming(r.stderr, "plots")
    assert len(warnings) == 1, r.stderr[-3000:]  # three doctors, one warning
    assert warnings[0] == (
        "WARNING monai_fast.report: doctor: drawing the report's PNGs needs matplotlib, which is not installed: "
        'pip install "monai-fast[plots]"; report.md is written without them'
    )
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_a_recipe_trains_with_the_core_alone_and_the_demo_names_its_extra_before_any_work(core_site, tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    code = f"""
        import logging
        from monai_fast.apps.cli import main
        from monai_fast.apps.sources.msd import load_msd_datalist
        from monai_fast.apps.sources.synthetic import generate_msd
        from monai_fast.apps.recipes import RecipeConfig
        from monai_fast.apps.training.run import run_to_target

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        generate_msd({str(data)!r}, "spleen-like", num_cases=4, shape=(48, 48, 32), progress=False)
        train, val = load_msd_datalist({str(data)!r}, val_fraction=0.25, seed=0)
        config = RecipeConfig(patch_size=(32, 32, 32), batch_size=1, num_samples=1, channels=(4, 8, 16),
                              strides=(2, 2), max_epochs=1, num_workers=0, cache_threads=1)
        r = run_to_target("baseline", train, val, config, "cpu", time_budget_s=60, run_dir={str(run)!r}, progress=False)
        print("trained |", r.epochs_run)
        try:
            rc = main(["demo", "--run-dir", {str(tmp_path / "demo")!r}, "--data-dir", {str(data)!r}])
        except SystemExit as stop:
            rc = stop.code
        print("demo |", rc)
    """
    r = _run_core(core_site, code)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    # the run trains and writes its record; NVTX ranges (nvidia extra) and TensorBoard events (plots) step aside
    assert "trained | 1" in r.stdout, r.stdout[-2000:]
    assert list(run.rglob("record.rank0.jsonl")), sorted(p.name for p in run.rglob("*"))
    assert not list(run.rglob("events.out.tfevents*"))
    tb = [line for line in r.stderr.splitlines() if "TensorBoard events are skipped" in line]
    assert len(tb) == 1 and 'pip install "monai-fast[plots]"' in tb[0], r.stderr[-3000:]
    # the demo names the plots extra in one line and writes nothing: no run folder, no data generated
    assert "demo | " in r.stdout and "demo | 0" not in r.stdout, r.stdout[-2000:]
    line = "monai-fast demo: the demo (its Dice-vs-time PNG and TensorBoard events) needs matplotlib"
    assert line in r.stdout + r.stderr and 'pip install "monai-fast[plots]"' in r.stdout + r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "demo").exists()
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_on_the_core_train_the_lab_the_profilers_and_the_fragment_name_or_skip_their_extras(core_site, tmp_path):
    data = tmp_path / "data"
    small = ["--data-dir", str(data), "--patch-size", "16", "16", "16", "--channels", "4", "8", "--max-epochs", "1"]
    code = f"""
        import logging
        from monai_fast.apps.cli import main
        from monai_fast.apps.sources.synthetic import generate_msd
        from monai_fast.apps.demo.lab import lab_data
        from monai_fast.extras import MissingExtraError
        from monai_fast.handlers import NVTXHandler

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        generate_msd({str(data)!r}, "spleen-like", num_cases=4, shape=(32, 32, 32), progress=False)
        for name, extra in (("asked", ["--tensorboard-dir", {str(tmp_path / "tb")!r}]), ("plain", [])):
            out = {str(tmp_path)!r} + "/" + name
            try:
                rc = main(["train", *{small!r}, "--no-progress", "--output-dir", out, *extra])
            except SystemExit as stop:
                rc = stop.code
            print(name, "|", rc)
        main(["bundle", "fragment", "--out", {str(tmp_path / "fast.json")!r}])
        print("nvtx |", NVTXHandler().backend)
        from ignite.engine import Engine
        from monai_fast.handlers import GPUSampler
        GPUSampler().attach(Engine(lambda engine, batch: None))
        try:
            lab_data("tiny")
        except MissingExtraError as e:
            print("lab |", e)
    """
    r = _run_core(core_site, code)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    said = r.stdout + r.stderr
    # asked for TensorBoard: one line naming the extra, before any folder is made or any data read
    assert "train --tensorboard-dir needs tensorboard, which is not installed" in said, said[-3000:]
    assert "asked | 0" not in said
    assert not (tmp_path / "asked").exists() and not (tmp_path / "tb").exists()
    # not asked: it trains and writes its results; the PNG, a by-product, is skipped with one warning
    assert "plain | 0" in r.stdout, said[-3000:]
    assert (tmp_path / "plain" / "results.json").is_file() and not list(tmp_path.rglob("dice_vs_time.png"))
    assert len([line for line in r.stderr.splitlines() if "dice_vs_time.png: it needs matplotlib" in line]) == 1
    # NVTX ranges without the nvidia extra: one warning, no ranges; the lab names its extra before writing data
    assert "nvtx | None" in r.stdout and "NVTXHandler: NVTX ranges" in r.stderr, said[-3000:]
    # the fragment is written; the command it suggests names the extra MONAI's command line needs
    assert (
        tmp_path / "fast.json"
    ).is_file() and 'needs fire, which is not installed: pip install "monai-fast[bundle]"' in r.stdout
    # GPU sampling without the nvidia extra: the extra is advised only where NVIDIA's driver runs
    sampler = [line for line in r.stderr.splitlines() if "GPU sampling is off" in line]
    driver = Path("/proc/driver/nvidia").exists()
    assert len(sampler) == 1 and ("monai-fast[nvidia]" in sampler[0]) == driver, sampler
    assert "lab | the lab (its TensorBoard images and prediction figure) needs matplotlib" in r.stdout, said[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_a_yaml_bundle_or_auto3dseg_folder_without_pyyaml_is_one_line_naming_the_bundle_extra(core_site, tmp_path):
    zoo = tmp_path / "zoo" / "configs"
    zoo.mkdir(parents=True)
    (zoo / "train.yaml").write_text("network_def: {_target_: UNet}\n")
    algo = tmp_path / "algo" / "configs"
    algo.mkdir(parents=True)
    (algo / "hyper_parameters.yaml").write_text("training: {num_images_per_batch: 1}\n")
    code = f"""
        import importlib.util
        assert importlib.util.find_spec("yaml") is None, "pyyaml is visible in the core-only environment"
        from monai_fast.apps.cli import main
        for argv in (["tune", "--bundle", {str(zoo.parent)!r}], ["tune", "--bundle", {str(algo.parent)!r}],
                     ["bundle", "run", {str(zoo.parent)!r}]):
            try:
                main(argv)
            except SystemExit as stop:
                print("STOP", stop)
    """
    r = _run_core(core_site, code)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-4000:]
    stops = [line for line in r.stdout.splitlines() if line.startswith("STOP")]
    assert len(stops) == 3, r.stdout
    for stop, config in zip(stops, (zoo / "train.yaml", algo / "hyper_parameters.yaml", zoo / "train.yaml")):
        assert f"reading the YAML config {config} needs yaml" in stop, stop
        assert stop.endswith('pip install "monai-fast[bundle]"'), stop


def test_a_bundle_with_tensorboard_handlers_names_the_bundle_extra_before_anything_is_built(core_site, tmp_path):
    bundle, data = tmp_path / "seg3d", tmp_path / "data"
    shutil.copytree(ROOT / "tests" / "bundles" / "seg3d", bundle)
    code = f"""
        from monai_fast.apps.cli import main
        try:
            rc = main(["bundle", "run", {str(bundle)!r}, "dataset_dir={data}", "max_epochs=1"])
        except SystemExit as stop:
            rc = stop.code
        print("rc |", rc)
    """
    r = _run_core(core_site, code)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    line = (
        "monai-fast bundle: the config's TensorBoardStatsHandler (train#handlers#3) needs tensorboard, "
        'which is not installed: pip install "monai-fast[bundle]"'
    )
    assert f"rc | {line}" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (bundle / "eval").exists()  # nothing built, no record folder made
