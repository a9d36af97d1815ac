"""The core install alone runs FastTraining; a missing extra is one line naming it.

The environment with the core alone is real: a folder holding only the installed distributions
that monai-fast's core requirements pull in (their closure, read from the installed metadata), run
by ``python -S -E`` so no site-packages and no ``PYTHONPATH`` are seen. The extras' packages
(matplotlib, tensorboard, s3fs, tifffile, onnx, nvtx, nvidia-ml-py, nbclient) are simply not there.
"""

from __future__ import annotations

import importlib.metadata as md
import re
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
