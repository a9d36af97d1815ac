"""Data lists on S3: fetched once into the cache, re-fetched when changed, then trained as local files.

Against a real S3-compatible server (moto's, on 127.0.0.1, ``tests/s3_server.py``); credentials and
endpoint come from the environment (``AWS_*``), as they would for a user.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from ignite.engine import Events
from monai.data import DataLoader, Dataset
from monai.engines import SupervisedTrainer
from s3_server import s3_fixture, server_fixture  # noqa: F401 (pytest fixtures s3, server)

from monai_fast.apps.recipes import recipe_parts
from monai_fast.apps.sources.msd import case_id, load_msd_datalist
from monai_fast.apps.sources.remote import is_url, localize
from monai_fast.folders import cache_root


def upload_msd(client, bucket: str, folder: Path, prefix: str = "Task") -> list[dict[str, str]]:
    """Upload an MSD folder; the training pairs as ``s3://`` URLs."""
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(folder).as_posix()}")
    names = sorted(p.name for p in (folder / "imagesTr").glob("*.nii.gz"))
    base = f"s3://{bucket}/{prefix}"
    return [{"image": f"{base}/imagesTr/{n}", "label": f"{base}/labelsTr/{n}"} for n in names]


def test_remote_files_are_fetched_once_and_a_second_call_downloads_nothing(server, s3, tiny_spleen):
    client, bucket = s3
    urls = upload_msd(client, bucket, tiny_spleen)[:2]
    datalist = [dict(d, spacing=[1.5, 2.0]) for d in urls]
    first = localize(datalist)
    paths = [Path(p) for d in first for p in (d["image"], d["label"])]
    keys = [u.removeprefix("s3:/") for d in urls for u in (d["image"], d["label"])]  # /bucket/Task/imagesTr/...
    originals = [tiny_spleen / k.split("/Task/", 1)[1] for k in keys]
    assert all(p.is_relative_to(cache_root() / "remote") for p in paths)
    assert [p.name for p in paths] == [o.name for o in originals]
    assert [p.read_bytes() for p in paths] == [o.read_bytes() for o in originals]
    assert first[0]["spacing"] == [1.5, 2.0]
    gets_after_first = [server.gets(k) for k in keys]
    assert all(n >= 1 for n in gets_after_first)
    mtimes = [p.stat().st_mtime_ns for p in paths]

    second = localize(datalist)
    assert second == first
    assert [server.gets(k) for k in keys] == gets_after_first  # no download the second time
    assert [p.stat().st_mtime_ns for p in paths] == mtimes
    assert datalist[0]["image"].startswith("s3://")  # the caller's list is not changed


def test_a_changed_object_is_fetched_again(server, s3):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="cases/a.nii.gz", Body=b"version one")
    url = f"s3://{bucket}/cases/a.nii.gz"
    old = Path(localize([{"image": url}])[0]["image"])
    gets = server.gets(f"/{bucket}/cases/a.nii.gz")

    client.put_object(Bucket=bucket, Key="cases/a.nii.gz", Body=b"version two, a new ETag")
    new = Path(localize([{"image": url}])[0]["image"])
    assert new != old and new.name == "a.nii.gz"
    assert new.read_bytes() == b"version two, a new ETag"
    assert server.gets(f"/{bucket}/cases/a.nii.gz") > gets


def test_local_paths_and_file_urls_are_used_in_place(tmp_path):
    (tmp_path / "a.nii.gz").write_bytes(b"x")
    datalist = [{"image": str(tmp_path / "a.nii.gz"), "label": f"file://{tmp_path}/a.nii.gz", "fold": 2}]
    assert localize(datalist) == [{"image": str(tmp_path / "a.nii.gz"), "label": str(tmp_path / "a.nii.gz"), "fold": 2}]
    assert not (cache_root() / "remote").exists()
    assert is_url("s3://b/k") and is_url("gs://b/k") and not is_url("./imagesTr/a.nii.gz") and not is_url("nosuch://x")


def test_an_msd_folder_on_s3_gives_the_same_split_as_the_local_folder(s3, tiny_spleen):
    client, bucket = s3
    upload_msd(client, bucket, tiny_spleen, prefix="Task09")
    train, val = load_msd_datalist(f"s3://{bucket}/Task09", val_fraction=0.34, seed=0)
    local_train, local_val = load_msd_datalist(tiny_spleen, val_fraction=0.34, seed=0)
    assert [case_id(d["image"]) for d in train] == [case_id(d["image"]) for d in local_train]
    assert [case_id(d["image"]) for d in val] == [case_id(d["image"]) for d in local_val]
    for d, local in zip(train + val, local_train + local_val):
        assert Path(d["image"]).is_relative_to(cache_root() / "remote")
        assert Path(d["label"]).read_bytes() == Path(local["label"]).read_bytes()


@pytest.mark.timeout(300)
def test_a_monai_trainer_trains_one_epoch_on_a_localized_list(s3, tiny_spleen, tiny_config):
    client, bucket = s3
    files = localize(upload_msd(client, bucket, tiny_spleen)[:2])
    parts = recipe_parts("monai_tutorial", tiny_config, "cpu")
    loader = DataLoader(Dataset(files, parts.train_transforms()), batch_size=2, num_workers=0)
    torch.manual_seed(0)
    net = parts.network()
    losses: list[float] = []
    trainer = SupervisedTrainer(
        device=torch.device("cpu"),
        max_epochs=1,
        train_data_loader=loader,
        network=net,
        optimizer=parts.optimizer(net.parameters()),
        loss_function=parts.loss(),
        decollate=False,
    )
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output["loss"].detach().item())
    )
    trainer.run()
    assert trainer.state.epoch == 1 and trainer.state.iteration == 1
    assert len(losses) == 1 and math.isfinite(losses[0])


def test_an_msd_folder_on_s3_is_read_from_the_cache_the_second_time(server, s3, tiny_spleen):
    client, bucket = s3
    upload_msd(client, bucket, tiny_spleen, prefix="Task09")
    first = load_msd_datalist(f"s3://{bucket}/Task09", val_fraction=0.34, seed=0)
    meta = f"/{bucket}/Task09/dataset.json"
    gets = server.gets(meta)
    assert gets == 1
    copies = list((cache_root() / "remote").rglob("dataset.json"))
    assert len(copies) == 1 and copies[0].read_bytes() == (tiny_spleen / "dataset.json").read_bytes()
    assert load_msd_datalist(f"s3://{bucket}/Task09", val_fraction=0.34, seed=0) == first
    assert server.gets(meta) == gets  # looked up (HEAD), not downloaded again


@pytest.mark.parametrize("bad", [{"retries": -1}, {"read_timeout": 0}, {"connect_timeout": -2.0}, {"workers": 0}])
def test_time_limits_and_retries_are_checked(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        localize([{"image": "s3://bucket/a.nii.gz"}], **bad)
