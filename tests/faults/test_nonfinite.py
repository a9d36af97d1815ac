"""Non-finite losses in fp32 and under DDP: skipped steps, a clear error naming the file, ranks in step."""

from __future__ import annotations

import shutil

import nibabel as nib
import numpy as np
import pytest
import torch
from ignite import distributed as idist
from ignite.engine import Events
from monai.data import DataLoader
from monai.engines import SupervisedTrainer

from monai_fast.apps.launch import run
from monai_fast.apps.recipes import build_recipe
from monai_fast.handlers import NonFiniteGuard, NonFiniteLossError
from monai_fast.handlers.lifecycle import handlers_on


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


def _nan_copy(tiny_files, tmp_path):
    """A copy of the tiny data set whose first training image is NaN over the organ; returns (train, val, bad path).

    (An image that is NaN everywhere never reaches the loss: the foreground crop finds no voxel and
    the loader stops with an error naming the file.)
    """
    train, val = tiny_files
    copies = []
    for item in train:
        new = {}
        for key, path in item.items():
            dst = tmp_path / key / path.split("/")[-1]
            dst.parent.mkdir(exist_ok=True)
            shutil.copy(path, dst)
            new[key] = str(dst)
        copies.append(new)
    bad = copies[0]["image"]
    img, label = nib.load(bad), nib.load(copies[0]["label"])
    voxels = np.asarray(img.dataobj, dtype=np.float32)
    voxels[np.asarray(label.dataobj) > 0] = np.nan
    nib.save(nib.Nifti1Image(voxels, img.affine), bad)
    return copies, val, bad


def test_a_nan_image_in_fp32_stops_with_an_error_naming_the_file(tiny_files, tiny_config, tmp_path):
    train, val, bad = _nan_copy(tiny_files, tmp_path)
    config = type(tiny_config)(**{**tiny_config.to_dict(), "max_epochs": 4, "precision": "fp32"})
    r = build_recipe("fast", train, val, config, progress=False)
    assert NonFiniteGuard in handlers_on(r.trainer) and not r.amp  # fp32: the guard is there all the same
    with pytest.raises(NonFiniteLossError, match="NaN/Inf") as err:
        r.trainer.run()
    assert bad in str(err.value) and "iteration" in str(err.value) and "epoch" in str(err.value)
    assert r.trainer.state.epoch < 4  # stopped, not trained to the end
    assert all(torch.isfinite(p).all() for p in r.network.parameters())
    assert all(torch.isfinite(b).all() for b in r.network.buffers() if b.is_floating_point())


def _nan_loss_at(trainer, iterations):
    """The trainer's real loss, NaN at the given iterations (a numerical blow-up from finite inputs)."""
    inner = trainer.loss_function
    trainer.loss_function = lambda pred, label: (
        inner(pred, label) * (float("nan") if trainer.state.iteration in iterations else 1.0)
    )


def _tiny_trainer(data, epochs=1, network=None):
    torch.manual_seed(0)
    net = (
        network
        if network is not None
        else torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3, padding=1), torch.nn.BatchNorm3d(2))
    )
    return SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=epochs,
        train_data_loader=DataLoader(data, batch_size=2),
        network=net,
        optimizer=torch.optim.AdamW(net.parameters(), lr=0.1),
        loss_function=torch.nn.MSELoss(),
    )


def _volumes(n, nan_batch=None):
    g = torch.Generator().manual_seed(1)
    data = [
        {"image": torch.rand(1, 8, 8, 8, generator=g), "label": torch.rand(2, 8, 8, 8, generator=g)} for _ in range(n)
    ]
    if nan_batch is not None:  # both items of that batch (batch_size 2)
        for item in data[2 * nan_batch : 2 * nan_batch + 2]:
            item["image"] = torch.full_like(item["image"], float("nan"))
    return data


@pytest.mark.parametrize("source", ["loss", "input"])
def test_a_single_nan_batch_in_fp32_is_skipped_and_training_goes_on(source):
    t = _tiny_trainer(_volumes(8, nan_batch=1 if source == "input" else None))
    if source == "loss":
        _nan_loss_at(t, {2})
    guard = NonFiniteGuard()
    guard.attach(t)
    snaps = {}
    t.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: snaps.__setitem__(e.state.iteration, (_params(t.network), [b.clone() for b in t.network.buffers()])),
    )
    t.run()
    assert t.state.iteration == 4 and guard.stats["skipped_steps"] == 1
    for before, after in zip(snaps[1][0] + snaps[1][1], snaps[2][0] + snaps[2][1], strict=True):
        assert torch.equal(before, after)  # the NaN step changed neither weights nor batch-norm statistics
    assert not all(torch.equal(a, b) for a, b in zip(snaps[2][0], snaps[3][0], strict=True))  # training went on
    assert all(torch.isfinite(p).all() for p in t.network.parameters())


def test_a_finite_loss_with_nan_gradients_skips_its_step_and_training_goes_on(caplog):
    t = _tiny_trainer(_volumes(8))
    inner = t.loss_function

    def loss(pred, label):  # finite (sqrt(0) = 0), but its gradient is 0 * inf = NaN at iteration 2
        zero = torch.sqrt(pred.sum() * 0) if t.state.iteration == 2 else 0
        return inner(pred, label) + zero

    t.loss_function = loss
    guard = NonFiniteGuard()
    guard.attach(t)
    snaps = {}
    t.add_event_handler(Events.ITERATION_COMPLETED, lambda e: snaps.__setitem__(e.state.iteration, _params(t.network)))
    with caplog.at_level("WARNING", logger="monai_fast.handlers"):
        t.run()
    assert guard.stats["skipped_steps"] == 1 and guard.streak == 0
    assert all(torch.equal(a, b) for a, b in zip(snaps[1], snaps[2], strict=True))  # the NaN gradient never applied
    assert not all(torch.equal(a, b) for a, b in zip(snaps[2], snaps[3], strict=True))
    assert all(torch.isfinite(p).all() for p in t.network.parameters())
    assert "non-finite gradient from a finite loss at iteration 2 (epoch 1)" in caplog.text


def test_finite_gradients_too_large_for_a_float32_sum_pass_and_a_nan_anywhere_does_not():
    from monai_fast.handlers.guards import _grads_finite

    w, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    optimizer = torch.optim.SGD([w, b], lr=0.1)
    w.grad, b.grad = torch.full((4,), 3e38), torch.full((2,), 3e38, dtype=torch.bfloat16)
    assert _grads_finite(optimizer)  # finite, though their sum overflows float32
    b.grad[1] = float("nan")
    assert not _grads_finite(optimizer)


def test_a_nan_loss_under_monais_amp_on_a_cpu_leaves_the_weights_finite():
    """MONAI's amp=True on a CPU steps through a GradScaler that is off: the step is dropped, not filled with NaN."""
    t = _tiny_trainer(_volumes(8))
    t.amp, t.scaler = True, torch.amp.GradScaler("cpu", enabled=False)
    _nan_loss_at(t, {2})
    guard = NonFiniteGuard()
    guard.attach(t)
    t.run()
    assert guard.stats["skipped_steps"] == 1 and t.state.iteration == 4
    assert all(torch.isfinite(p).all() for p in t.network.parameters())


def test_nonfinite_losses_in_a_row_in_fp32_stop_with_the_iteration_and_epoch():
    t = _tiny_trainer(_volumes(4), epochs=3)
    _nan_loss_at(t, {3, 4, 5, 6})
    NonFiniteGuard(max_nonfinite=2).attach(t)
    with pytest.raises(NonFiniteLossError, match=r"2 non-finite steps in a row .*iteration 4 \(epoch 2\)"):
        t.run()
    assert all(torch.isfinite(p).all() for p in t.network.parameters())


def _ddp_main(local_rank, out_dir):
    rank = idist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Conv3d(1, 2, 3, padding=1))
    data = _volumes(6)
    if rank == 1:  # iteration 2 is the second batch of two items
        for item in data[2:4]:
            item["image"] = torch.full_like(item["image"], float("nan"))
    t = _tiny_trainer(data, network=net)
    guard = NonFiniteGuard()
    guard.attach(t)
    steps = {}
    t.add_event_handler(Events.ITERATION_COMPLETED, lambda e: steps.__setitem__(e.state.iteration, _params(net)))
    t.run()
    torch.save({"steps": steps, "stats": guard.stats}, f"{out_dir}/rank{rank}.pt")


def test_under_ddp_a_nan_batch_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    # a real 2-process gloo group (spawned, with a collective timeout); only rank 1 gets a NaN batch, at iteration 2
    run(_ddp_main, str(tmp_path), nproc_per_node=2, timeout_s=60)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["stats"]["skipped_steps"] == r1["stats"]["skipped_steps"] == 1
    for it in (1, 2, 3):
        assert all(torch.equal(a, b) for a, b in zip(r0["steps"][it], r1["steps"][it], strict=True))  # ranks equal
    assert all(torch.equal(a, b) for a, b in zip(r0["steps"][1], r0["steps"][2], strict=True))  # both skipped 2
    assert not all(torch.equal(a, b) for a, b in zip(r0["steps"][2], r0["steps"][3], strict=True))
    assert all(torch.isfinite(p).all() for p in r0["steps"][3])
