"""S3 downloads through a stalling or throttling link: bounded, retried, named, interruptible, never half a file.

A real TCP proxy (``tests/stall_proxy.py``) on 127.0.0.1 sits between the client and a real
S3-compatible server (moto's, ``tests/s3_server.py``): it forwards each GET, then stops sending
mid-body while keeping the socket open, or sends the body slowly. The client finds the server the
way a user's would, through ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from s3_server import s3_fixture, s3fs, server_fixture  # noqa: F401 (pytest fixtures s3, server)
from stall_proxy import Stall, StallProxy, Throttle

from monai_fast.apps.sources.remote import RemoteDataError, localize
from monai_fast.folders import cache_root

LIMITS = {"connect_timeout": 1.0, "read_timeout": 1.0}


def cached_files() -> list[Path]:
    """Every file under the remote cache folder, temporary ones included."""
    root = cache_root() / "remote"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.fixture
def proxy(server, s3, monkeypatch):
    """A stall proxy in front of ``server``; the client's endpoint is the proxy."""
    url = urlsplit(server.url)
    p = StallProxy(url.hostname, url.port).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    s3fs.S3FileSystem.clear_instance_cache()
    yield p
    p.stop()


def put(s3, key: str, size: int) -> tuple[str, bytes]:
    client, bucket = s3
    payload = os.urandom(size)
    client.put_object(Bucket=bucket, Key=key, Body=payload)
    return f"s3://{bucket}/{key}", payload


@pytest.mark.timeout(60)
def test_a_server_that_stops_sending_mid_body_is_one_error_naming_the_url(s3, proxy):
    url, payload = put(s3, "imagesTr/big.nii.gz", 1 << 20)
    proxy.rules[f"/{s3[1]}/imagesTr/big.nii.gz"] = Stall(after=256 << 10)
    start = time.monotonic()
    with pytest.raises(RemoteDataError) as err:
        localize([{"image": url}], progress=False, retries=1, **LIMITS)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert f"fetching {url} failed after 2 tries" in message
    # the proxy passed 256 KiB, response headers included
    assert re.search(
        r"stalled after 26\d{4} of 1048576 bytes: fewer than 64 KiB arrived in 1 s \(read_timeout\)", message
    ), message
    assert "no file was left at" in message
    assert len(proxy.matched) == 2  # the first try and one retry, each stalled
    assert elapsed < 15, f"a stall of a 1 s read_timeout took {elapsed:.1f} s to report"
    assert cached_files() == []  # neither the final file nor a temporary one

    proxy.rules.clear()  # the link is healthy again: the whole object arrives
    files = localize([{"image": url}], progress=False, **LIMITS)
    assert Path(files[0]["image"]).read_bytes() == payload


@pytest.mark.timeout(60)
def test_a_slow_but_steady_body_arrives_whole_and_a_trickle_is_a_stall(s3, proxy):
    url, payload = put(s3, "imagesTr/slow.nii.gz", 768 << 10)
    key = f"/{s3[1]}/imagesTr/slow.nii.gz"
    proxy.rules[key] = Throttle(chunk=1 << 10, every=0.05)  # 20 KiB/s: below 64 KiB per read_timeout
    stalled = r"stalled after \d+ of 786432 bytes: fewer than 64 KiB arrived in 1 s"
    with pytest.raises(RemoteDataError, match=stalled) as err:
        localize([{"image": url}], progress=False, retries=0, **LIMITS)
    assert f"fetching {url} failed after 1 try" in str(err.value)
    assert cached_files() == []

    proxy.rules[key] = Throttle(chunk=32 << 10, every=0.05)  # 640 KiB/s: slow, but never silent for 1 s
    start = time.monotonic()
    files = localize([{"image": url}], progress=False, retries=0, **LIMITS)
    assert Path(files[0]["image"]).read_bytes() == payload
    assert time.monotonic() - start > 1.0  # it went through the throttle, longer than one read_timeout


# Python installs its KeyboardInterrupt handler only where SIGINT is not ignored, and a command started
# in the background of a shell without job control (a script's `pytest ... &`, some CI runners) has
# SIGINT ignored, inherited by every child: the child puts back the handler an interactive Python has.
_CHILD = textwrap.dedent(
    """
    import signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from monai_fast.apps.sources.remote import localize
    localize([{"image": sys.argv[1]}], progress=False)
    print("finished", flush=True)
    """
)


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_stalled_download_ends_the_process_at_once_and_leaves_no_file(s3, proxy, tmp_path):
    url, _ = put(s3, "imagesTr/stuck.nii.gz", 1 << 20)
    proxy.rules[f"/{s3[1]}/imagesTr/stuck.nii.gz"] = Stall(after=256 << 10)
    out_file, err_file = tmp_path / "child.out", tmp_path / "child.err"
    with open(out_file, "w") as out, open(err_file, "w") as errs:  # files, not pipes: only the child's end is timed
        child = subprocess.Popen([sys.executable, "-c", _CHILD, url], stdout=out, stderr=errs)
    try:
        assert proxy.stalled.wait(30), "the child never reached the stalled body"
        time.sleep(0.5)  # the child is now blocked in the silent read (default read_timeout 30 s)
        assert cached_files(), "the child writes into a temporary file while the body streams"
        assert child.poll() is None
        child.send_signal(signal.SIGINT)
        start = time.monotonic()
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process was still alive {time.monotonic() - start:.1f} s after SIGINT")
        took = time.monotonic() - start
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # well before the 30 s read_timeout a SIGINT left waiting would end at; a busy host may take seconds to
    # unwind and shut down an interpreter with torch loaded
    assert took < 10.0, f"the process took {took:.1f} s to end after SIGINT"
    assert child.returncode != 0 and "finished" not in out_file.read_text()
    assert "KeyboardInterrupt" in err_file.read_text()
    assert cached_files() == []  # no partial file under the final name, no temporary file


def test_ctrl_c_while_the_fetch_threads_start_stops_the_ones_already_running():
    """A real SIGINT sent by the first fetch thread lands while the main thread still starts the others."""
    from monai_fast.apps.sources.remote_io import _parallel, _Stopped

    stop = threading.Event()
    stopped: list[str] = []

    def fetch(item: str) -> None:
        if item == "0":
            os.kill(os.getpid(), signal.SIGINT)
        if stop.wait(10):
            stopped.append(item)
            raise _Stopped()

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # also where SIGINT came ignored
    try:
        with pytest.raises(KeyboardInterrupt):
            _parallel(fetch, [str(i) for i in range(32)], 32, stop)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stop.is_set(), "Ctrl-C between two thread starts left the started downloads running"
    deadline = time.monotonic() + 5
    while "0" not in stopped and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "0" in stopped
