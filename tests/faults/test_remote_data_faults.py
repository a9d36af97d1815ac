"""Remote data lists under faults: missing keys named before any download, a dropped connection leaves no file.

A real S3-compatible server (moto's, ``tests/s3_server.py``) on 127.0.0.1; the dropped connection
is the server shutting the socket after part of the body, on every GET of that object.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from s3_server import s3_fixture, server_fixture  # noqa: E402, F401 (pytest fixtures s3, server)

from monai_fast.data.msd import load_msd_datalist  # noqa: E402
from monai_fast.data.remote import RemoteDataError, localize  # noqa: E402
from monai_fast.files import cache_root  # noqa: E402


def cached_files() -> list[Path]:
    """Every file under the remote cache folder, temporary ones included."""
    root = cache_root() / "remote"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_missing_keys_are_all_named_before_anything_is_downloaded(server, s3):
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="imagesTr/a.nii.gz", Body=b"present")
    datalist = [
        {"image": f"s3://{bucket}/imagesTr/a.nii.gz", "label": f"s3://{bucket}/labelsTr/a.nii.gz"},
        {"image": f"s3://{bucket}/imagesTr/b.nii.gz", "label": f"s3://{bucket}/imagesTr/a.nii.gz"},
    ]
    with pytest.raises(FileNotFoundError) as err:
        localize(datalist)
    message = str(err.value)
    assert f"s3://{bucket}/labelsTr/a.nii.gz (at [0]['label'])" in message
    assert f"s3://{bucket}/imagesTr/b.nii.gz (at [1]['image'])" in message
    assert "2 remote file(s)" in message
    assert server.gets(f"/{bucket}/imagesTr/a.nii.gz") == 0 and cached_files() == []


def test_a_missing_remote_dataset_json_is_named(s3):
    _, bucket = s3
    with pytest.raises(FileNotFoundError, match=f"s3://{bucket}/Task09/dataset.json"):
        load_msd_datalist(f"s3://{bucket}/Task09")


@pytest.mark.timeout(120)
def test_a_dropped_connection_leaves_no_file_and_names_the_url(server, s3):
    client, bucket = s3
    payload = os.urandom(3 << 20)
    client.put_object(Bucket=bucket, Key="imagesTr/big.nii.gz", Body=payload)
    client.put_object(Bucket=bucket, Key="labelsTr/big.nii.gz", Body=b"small label")
    url = f"s3://{bucket}/imagesTr/big.nii.gz"
    datalist = [{"image": url, "label": f"s3://{bucket}/labelsTr/big.nii.gz"}]
    server.cut[f"/{bucket}/imagesTr/big.nii.gz"] = 256 << 10  # every GET of it breaks after 256 KiB
    try:
        with pytest.raises(RemoteDataError, match=f"fetching {url} failed") as err:
            localize(datalist, workers=2)
    finally:
        server.cut.clear()
    assert "no file was left at" in str(err.value)
    assert server.gets(f"/{bucket}/imagesTr/big.nii.gz") >= 1
    # no image file at its final path nor a temporary one: at most the complete label, if it finished first
    assert all(p.read_bytes() == b"small label" for p in cached_files())

    files = localize(datalist, workers=2)  # the connection is back: the whole object arrives
    assert Path(files[0]["image"]).read_bytes() == payload
