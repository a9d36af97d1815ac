"""``monai-fast launch`` at a rendezvous that never forms: it says what it waits for, and stops within --rdzv-timeout.

The endpoint is a real listening socket on 127.0.0.1 held by a program that accepts every connection
and never answers (torch's store client then waits without a time-out of its own); the launcher is a
real ``monai-fast launch`` subprocess running real torchrun.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from monai_fast.distributed.launch import LaunchSpec, rendezvous_timeout_message, torchrun_args


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on 127.0.0.1 whose program accepts connections and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    for s in (*held, server):
        s.close()


def _launch(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, float]:
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    log = open(tmp_path / "launch.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "monai_fast.cli", "launch", "--nproc", "1", *args, str(script)],
        cwd=tmp_path,
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    return proc, time.monotonic()


def _end(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait for ``proc``; on a hang kill it and everything it started, then fail."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            p.kill()
        proc.wait()
        pytest.fail(f"monai-fast launch still ran after {timeout_s} s")


@pytest.mark.parametrize("nnodes", ["1", "2"])
def test_a_silent_endpoint_is_named_at_once_and_the_launch_stops_within_the_bound(tmp_path, silent_port, nnodes):
    endpoint = f"127.0.0.1:{silent_port}"
    proc, started = _launch(
        tmp_path, "--nnodes", nnodes, "--rdzv-endpoint", endpoint, "--rdzv-id", f"job{nnodes}", "--rdzv-timeout", "2"
    )
    _end(proc, 30)
    took = time.monotonic() - started
    out = (tmp_path / "launch.log").read_text()
    assert proc.returncode != 0, out
    assert took < 30, took
    assert f"waiting for the rendezvous at {endpoint}" in out and "(up to 2 s; --rdzv-timeout)" in out, out
    final = [line for line in out.splitlines() if line.startswith("monai-fast launch: ")]
    assert len(final) == 1, out
    assert f"no rendezvous at {endpoint} within --rdzv-timeout 2 s" in final[0], out
    assert "accepts connections" in final[0] and "free port" in final[0], out
    assert "Traceback" not in out, out
    assert not (tmp_path / "ran").exists()
    for p in psutil.process_iter(["cmdline"]):
        assert f"--rdzv-endpoint={endpoint}" not in " ".join(p.info["cmdline"] or []), "torchrun left behind"


def test_sigterm_at_a_silent_rendezvous_ends_the_launch_in_seconds(tmp_path, silent_port):
    """No rank has started, so there is nothing to checkpoint: the --grace-s wait (120 s) does not apply."""
    endpoint = f"127.0.0.1:{silent_port}"
    proc, _ = _launch(tmp_path, "--rdzv-endpoint", endpoint, "--rdzv-id", "j", "--rdzv-timeout", "300")
    deadline = time.monotonic() + 60
    while "waiting for the rendezvous" not in (tmp_path / "launch.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
        time.sleep(0.1)
    time.sleep(3)  # torchrun is now at the store
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _end(proc, 30)
    assert time.monotonic() - sent < 20
    assert proc.returncode != 0
    for p in psutil.process_iter(["cmdline"]):
        assert f"--rdzv-endpoint={endpoint}" not in " ".join(p.info["cmdline"] or []), "torchrun left behind"


def test_the_bound_reaches_torchruns_join_timeout_and_a_refused_port_names_the_host():
    spec = LaunchSpec(nproc=1, nnodes=2, rdzv_endpoint="h:29400", rdzv_id="j", rdzv_timeout_s=45)
    assert "--rdzv-conf=join_timeout=45" in torchrun_args(spec)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    message = rendezvous_timeout_message(
        LaunchSpec(nproc=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="j", rdzv_timeout_s=5)
    )
    assert message.startswith(f"no rendezvous at 127.0.0.1:{port} within --rdzv-timeout 5 s: nothing listens"), message


def test_a_bad_rdzv_timeout_is_named_before_anything_starts(tmp_path):
    from monai_fast.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["launch", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--rdzv-timeout", "0", str(script)])
    assert "--rdzv-timeout must be > 0 seconds, got 0" in str(e.value)
