"""Shared parts of the background-fill tests: tiny NIfTI files, a chain with held items, a real trainer."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from ignite.engine import Events
from monai.engines import SupervisedTrainer
from monai.transforms import Compose, EnsureChannelFirstd, Lambdad, LoadImaged, RandSpatialCropd

from monai_fast.data.planner import plan_cache


def write_cases(folder: Path, n: int = 8) -> list[dict[str, str]]:
    """``n`` cases of 8x8x8 voxels, image i filled with i, written with nibabel."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n):
        image, label = folder / f"case_{i}.nii.gz", folder / f"case_{i}_seg.nii.gz"
        nib.save(nib.Nifti1Image(np.full((8, 8, 8), float(i), np.float32), np.eye(4)), str(image))
        nib.save(nib.Nifti1Image((np.arange(512).reshape(8, 8, 8) % 2).astype(np.float32), np.eye(4)), str(label))
        files.append({"image": str(image), "label": str(label)})
    return files


class Held:
    """A deterministic step that holds named cases: until ``release`` is set (at most ``wait_s``), or raises."""

    def __init__(
        self, hold: tuple[str, ...] = (), fail: str | None = None, wait_s: float = 20.0, sleep_s: float = 0.0
    ) -> None:
        self.hold, self.fail, self.wait_s, self.sleep_s = hold, fail, wait_s, sleep_s
        self.release = threading.Event()
        self.done: dict[str, float] = {}  # case -> time.monotonic() its deterministic part ended
        self.timed_out = False

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        name = Path(str(image.meta["filename_or_obj"])).name.split(".")[0]
        if self.fail is not None and name == self.fail:
            raise ValueError(f"broken on purpose: {name}")
        if name in self.hold:
            self.timed_out |= not self.release.wait(self.wait_s)
        time.sleep(self.sleep_s)
        self.done[name] = time.monotonic()
        return image


def chain(held: Held, random: bool = True) -> Compose:
    steps = [LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"]), Lambdad("image", held)]
    return Compose(
        steps + ([RandSpatialCropd(keys=["image", "label"], roi_size=(4, 4, 4), random_size=False)] if random else [])
    )


def planned(files: list[dict], held: Held, background: bool, random: bool = True, workers: int = 1):
    """The planner's RAM cache of ``files`` built with or without the background fill."""
    transform = chain(held, random)
    plan = plan_cache(Compose(transform.transforms[:2]), files[:1], "cpu", ram_budget_mib=1024, sample=1)
    return plan.build(files, transform, background=background, num_workers=workers)


def case_names(batch: dict) -> list[str]:
    return [Path(str(f)).name.split(".")[0] for f in batch["image"].meta["filename_or_obj"]]


def trainer(loader, epochs: int) -> tuple[SupervisedTrainer, list[list[str]], dict]:
    """A real ``SupervisedTrainer`` (a 1x1x1 conv) that records each epoch's cases and the first iteration's time."""
    torch.manual_seed(0)
    net = torch.nn.Conv3d(1, 1, 1)
    seen: list[list[str]] = []
    times: dict = {}
    t = SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=epochs,
        train_data_loader=loader,
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), 0.01),
        loss_function=torch.nn.MSELoss(),
    )

    @t.on(Events.EPOCH_STARTED)
    def _epoch(engine) -> None:
        seen.append([])

    @t.on(Events.ITERATION_STARTED)
    def _record(engine) -> None:
        seen[-1].extend(case_names(engine.state.batch))

    @t.on(Events.ITERATION_COMPLETED(once=1))
    def _first(engine) -> None:
        times["first_iteration"] = time.monotonic()

    return t, seen, times
