"""The crop-reading tier across nodes: two real torchrun nodes (one gloo rank each, on this host).

When both nodes' ranks see the same cache folder (a shared file system), the job's ranks split the fill and
write one copy for the whole job; when each node has a folder of its own (node-local disks, here one folder
per node), each node writes its own copy. Either way every rank trains on its ``DistributedSampler``'s items.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from monai_fast.apps.sources.synthetic import generate_msd

NODE_SCRIPT = """
import json, os, sys
from pathlib import Path

import ignite.distributed as idist
import torch
from monai.data import DataLoader, Dataset
from monai.engines import SupervisedTrainer
from monai.losses import DiceLoss
from monai.networks.nets import UNet
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandCropByPosNegLabeld
from torch.utils.data import DistributedSampler

from monai_fast.handlers import FastTraining

out, files = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
idist.initialize("gloo")
keys = ["image", "label"]
chain = Compose(
    [LoadImaged(keys), EnsureChannelFirstd(keys),
     RandCropByPosNegLabeld(keys, label_key="label", spatial_size=(16, 16, 16), num_samples=1)]
)
ds = Dataset(files, chain)
loader = DataLoader(ds, batch_size=1, sampler=DistributedSampler(ds, shuffle=True, seed=0))
net = UNet(3, 1, 2, channels=(4, 8), strides=(2,), num_res_units=0)
trainer = SupervisedTrainer(
    device="cpu", max_epochs=1, train_data_loader=loader, network=net,
    optimizer=torch.optim.SGD(net.parameters(), 0.01), loss_function=DiceLoss(to_onehot_y=True, softmax=True),
)
fast = FastTraining(cache_dir=os.environ["NODE_CACHE"], memory_format=False, compile=False, prefetch=False,
                    precision=False, tune_store=None)
fast.attach(trainer)
trainer.run()
(out / f"data.{idist.get_rank()}").write_text(json.dumps(
    {"reason": fast.applied["data"]["reason"], "nnodes": idist.get_nnodes(), "iterations": trainer.state.iteration}
))
idist.finalize()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path: Path, caches: list[Path]) -> list[dict]:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "node.py",
                "out",
                "files.json",
            ],
            cwd=tmp_path,
            env={**os.environ, "PYTHONWARNINGS": "ignore", "NODE_CACHE": str(caches[node]), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads((tmp_path / "out" / f"data.{r}").read_text()) for r in (0, 1)]


@pytest.fixture
def job(tmp_path):
    generate_msd(tmp_path / "data", num_cases=6, shape=(32, 32, 24), progress=False)
    images = sorted((tmp_path / "data" / "imagesTr").glob("*.nii.gz"))
    files = [{"image": str(p), "label": str(p).replace("imagesTr", "labelsTr")} for p in images]
    (tmp_path / "files.json").write_text(json.dumps(files))
    (tmp_path / "node.py").write_text(NODE_SCRIPT)
    (tmp_path / "out").mkdir()
    return tmp_path, files


def _wrote(reason: str) -> int:
    return int(reason.split("this rank wrote ")[1].split(" ")[0])


def _items(folder: Path) -> int:
    return len([p for p in folder.iterdir() if (p / "item.json").exists()])


def test_a_folder_every_node_sees_gets_one_copy_written_by_all_the_jobs_ranks(job):
    tmp_path, files = job
    shared = tmp_path / "shared"
    done = _two_nodes(tmp_path, [shared, shared])
    assert all(d["nnodes"] == 2 and d["iterations"] == len(files) // 2 for d in done), done
    assert all("shared by all 2 nodes" in d["reason"] and "the job's one copy" in d["reason"] for d in done), done
    assert [_wrote(d["reason"]) for d in done] == [len(files) // 2] * 2  # the job's ranks split the fill
    assert _items(shared) == len(files)
    assert not list((shared / ".nodes").iterdir())  # the marks are gone


def test_node_local_folders_get_a_copy_each(job):
    tmp_path, files = job
    local = [tmp_path / "node0", tmp_path / "node1"]
    done = _two_nodes(tmp_path, local)
    assert all("per node" in d["reason"] and "the node's one copy" in d["reason"] for d in done), done
    assert [_wrote(d["reason"]) for d in done] == [len(files)] * 2  # one rank per node writes its node's copy
    assert [_items(f) for f in local] == [len(files)] * 2


def test_a_read_only_folder_filled_before_trains_with_no_mark_and_no_wait(job, tmpfs):
    # an earlier job filled the shared cache, which is now read-only: no node can leave its mark, so each node
    # reads the folder as its own copy and writes nothing (before the marks were guarded, rank 0 raised and the
    # other rank waited at the barrier)
    tmp_path, files = job
    shared = tmpfs("size=64M", "shared")
    _two_nodes(tmp_path, [shared, shared])
    subprocess.run(["mount", "-o", "remount,ro", str(shared)], check=True)
    done = _two_nodes(tmp_path, [shared, shared])
    assert all("per node" in d["reason"] for d in done), done
    assert [_wrote(d["reason"]) for d in done] == [0, 0]
    assert all(d["iterations"] == len(files) // 2 for d in done), done
