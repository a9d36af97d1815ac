"""A rank that dies while the node's ranks fill their shared crop cache: real torchrun, two real gloo ranks.

The user's trainer keeps its ``DistributedSampler`` and FastTraining fills one ``CropCacheDataset`` per node,
each local rank writing its share. Once rank 0 has written its share, rank 1 is killed (``os._exit``) before
its own: the job must end within seconds with the launcher naming that rank, not wait at the fill's barrier;
the items written are whole, and the restarted job reuses them, writing only the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from monai_fast.apps.sources.synthetic import generate_msd

RANK_SCRIPT = """
import json, os, sys, time
from pathlib import Path

import ignite.distributed as idist
import torch
from monai.data import DataLoader, Dataset
from monai.engines import SupervisedTrainer
from monai.losses import DiceLoss
from monai.networks.nets import UNet
from monai.transforms import Compose, EnsureChannelFirstd, Lambdad, LoadImaged, RandCropByPosNegLabeld
from torch.utils.data import DistributedSampler

from monai_fast.handlers import FastTraining

out, files = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
made = []


def made_one(x):
    made.append(1)  # the kill's moment is read at call time: the chain, and so the cache's key, is the same
    if idist.get_rank() == 1 and len(made) == int(os.environ.get("KILL_AT_ITEM", 0)):
        deadline = time.monotonic() + 120  # rank 0 has written its share (4 items) before rank 1 dies in its own
        while len(list((out / "crops").glob("*/item.json"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(3)
    return x


idist.initialize("gloo")
keys = ["image", "label"]
chain = Compose(
    [
        LoadImaged(keys),
        EnsureChannelFirstd(keys),
        Lambdad(keys="image", func=made_one),
        RandCropByPosNegLabeld(keys, label_key="label", spatial_size=(16, 16, 16), num_samples=1),
    ]
)
ds = Dataset(files, chain)
loader = DataLoader(ds, batch_size=1, sampler=DistributedSampler(ds, shuffle=True, seed=0))
net = UNet(3, 1, 2, channels=(4, 8), strides=(2,), num_res_units=0)
trainer = SupervisedTrainer(
    device="cpu", max_epochs=1, train_data_loader=loader, network=net,
    optimizer=torch.optim.SGD(net.parameters(), 0.01), loss_function=DiceLoss(to_onehot_y=True, softmax=True),
)
fast = FastTraining(cache_dir=out / "crops", memory_format=False, compile=False, prefetch=False, precision=False)
fast.attach(trainer)
(out / f"data.{idist.get_rank()}").write_text(fast.applied["data"]["reason"])
trainer.run()
idist.finalize()
"""


def _launch(tmp_path: Path, env: dict[str, str], timeout: float = 240) -> tuple[int, str, float]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "monai_fast.apps.cli", "launch", "--nproc", "2", "rank.py", "out", "files.json"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


def test_a_rank_killed_during_the_shared_fill_ends_the_job_and_a_restart_reuses_what_was_written(tmp_path):
    generate_msd(tmp_path / "data", num_cases=8, shape=(32, 32, 24), progress=False)
    images = sorted((tmp_path / "data" / "imagesTr").glob("*.nii.gz"))
    files = [{"image": str(p), "label": str(p).replace("imagesTr", "labelsTr")} for p in images]
    (tmp_path / "files.json").write_text(json.dumps(files))
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    (tmp_path / "out").mkdir()

    rc, log, took = _launch(tmp_path, {"KILL_AT_ITEM": "2"})
    assert rc != 0 and "exitcode  : 3" in log and "rank      : 1" in log, log[-3000:]
    assert took < 120, took  # ended by the launcher, not by the process group's time-out (30 min)
    crops = tmp_path / "out" / "crops"
    written = [p for p in crops.iterdir() if (p / "item.json").exists()]
    assert len(written) == len(files) // 2  # rank 0's share, whole; rank 1's never written
    assert not [p for p in crops.iterdir() if p not in written and not p.name.startswith(".")], list(crops.iterdir())

    rc, log, _ = _launch(tmp_path, {})
    assert rc == 0, log[-3000:]
    reasons = [(tmp_path / "out" / f"data.{r}").read_text() for r in (0, 1)]
    wrote = [int(r.split("this rank wrote ")[1].split(" ")[0]) for r in reasons]
    assert wrote[0] == 0 and wrote[1] == len(files) - len(written), reasons  # only what was missing
    assert len([p for p in crops.iterdir() if (p / "item.json").exists()]) == len(files)
