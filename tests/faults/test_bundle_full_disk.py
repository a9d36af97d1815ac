"""A bundle's checkpoint on a full disk: the previous ``model.pt`` stays whole and the full disk is named in one line.

Real parts: the 2-D classification bundle of ``tests/bundles/cls2d`` run by ``monai-fast bundle run``
and by MONAI's own runner with the config fragment (``python -m monai.bundle run``), each as a
subprocess; its ``ckpt_dir`` on a real small tmpfs (the ``tmpfs`` fixture of ``tests/conftest.py``,
root only), filled by another writer before the run; MONAI's ``CheckpointSaver`` writes ``model.pt``
at the first validation.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from bundle_parts import bundle_cli, copy_bundle, monai_runner, small_cls2d, write_shapes

from monai_fast.bundle import write_fragment
from monai_fast.files import free_bytes

PREVIOUS = {"model": {"weight": torch.arange(64, dtype=torch.float32)}}  #: what an earlier run left as model.pt


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return write_shapes(tmp_path_factory.mktemp("shapes"))


@pytest.fixture
def full_ckpt_dir(tmpfs) -> Path:
    """A 1 MiB tmpfs holding an earlier run's ``model.pt``, filled by another writer to 8 KiB free."""
    folder = tmpfs("size=1M", "models")
    torch.save(PREVIOUS, folder / "model.pt")
    with open(folder / "filler.bin", "wb") as f:
        f.write(b"\0" * (free_bytes(folder) - (8 << 10)))
    return folder


def _overrides(shapes: Path, ckpt_dir: Path) -> dict:
    return {**small_cls2d(shapes), "max_epochs": 1, "ckpt_dir": str(ckpt_dir)}


def _previous_kept(ckpt_dir: Path) -> None:
    saved = torch.load(ckpt_dir / "model.pt", weights_only=True)
    assert torch.equal(saved["model"]["weight"], PREVIOUS["model"]["weight"])  # whole, not truncated nor replaced
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["filler.bin", "model.pt"]  # no temporary file left


def test_bundle_run_on_a_full_disk_keeps_the_previous_model_and_names_the_full_disk_in_one_line(
    tmp_path, shapes, full_ckpt_dir
):
    bundle = copy_bundle("cls2d", tmp_path)
    r = bundle_cli(bundle, _overrides(shapes, full_ckpt_dir), "--no-logging-file")
    assert r.returncode != 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"monai-fast bundle: {full_ckpt_dir / 'model.pt'}: no space left on the device"), last
    _previous_kept(full_ckpt_dir)


def test_the_fragment_under_monais_runner_on_a_full_disk_keeps_the_previous_model_and_says_so(
    tmp_path, shapes, full_ckpt_dir
):
    bundle = copy_bundle("cls2d", tmp_path)
    fragment = write_fragment(bundle / "configs" / "fast.json")
    r = monai_runner(bundle, [bundle / "configs" / "train.json", fragment], _overrides(shapes, full_ckpt_dir))
    assert r.returncode != 0, r.stdout[-3000:] + r.stderr[-3000:]
    # MONAI's runner prints the traceback (its last error wraps the expression that failed); the cause is one line
    full = [line for line in r.stderr.splitlines() if line.startswith("monai_fast.files.NoSpaceError: ")]
    assert full and full[0].startswith(
        f"monai_fast.files.NoSpaceError: {full_ckpt_dir / 'model.pt'}: no space left on the device"
    ), r.stderr[-3000:]
    _previous_kept(full_ckpt_dir)


def test_atomic_checkpoint_savers_keep_monais_naming_rotation_and_readable_permissions(tmp_path):
    """A real SupervisedTrainer with MONAI's interval and final savers: same files as MONAI writes, n_saved kept."""
    from monai.engines import SupervisedTrainer
    from monai.handlers import CheckpointSaver

    from monai_fast.bundle.checkpoints import atomic_checkpoints

    net = torch.nn.Linear(2, 1)
    data = [{"image": torch.randn(2, 2), "label": torch.randn(2, 1)} for _ in range(2)]
    savers = [
        CheckpointSaver(str(tmp_path / "every"), {"net": net}, save_interval=1, n_saved=2),
        CheckpointSaver(str(tmp_path / "final"), {"net": net}, save_final=True, final_filename="model.pt"),
    ]
    assert atomic_checkpoints([*savers, "not a saver"]) == 2
    trainer = SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=3,
        train_data_loader=data,
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss_function=torch.nn.MSELoss(),
        train_handlers=savers,
    )
    old = os.umask(0o022)
    try:
        trainer.run()
    finally:
        os.umask(old)
    assert sorted(p.name for p in (tmp_path / "every").iterdir()) == ["net_epoch=2.pt", "net_epoch=3.pt"]
    final = tmp_path / "final" / "model.pt"
    assert sorted(p.name for p in final.parent.iterdir()) == ["model.pt"]
    assert torch.equal(torch.load(final, weights_only=True)["weight"], net.weight.detach())
    assert final.stat().st_mode & 0o777 == 0o644  # the umask's, as MONAI's own in-place writes give
