"""``monai-fast launch`` at a rendezvous that never forms: it says what it waits for, and stops within a bound.

The endpoint is a real listening socket on 127.0.0.1 held by a program that accepts every connection
and never answers (torch's store client then waits without a time-out of its own): the launcher's
store probe names it within ``STORE_ANSWER_S`` (or ``--rdzv-timeout``, if shorter), before torchrun
starts. The launcher is a real ``monai-fast launch`` subprocess running real torchrun.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import psutil
import pytest
from torch.distributed import TCPStore

from monai_fast.apps.launch.torchrun import (
    STORE_ANSWER_S,
    LaunchSpec,
    rendezvous_timeout_message,
    torchrun_args,
    unanswered_endpoint_message,
)


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
        [sys.executable, "-m", "monai_fast.apps.cli", "launch", "--nproc", "1", *args, str(script)],
        cwd=tmp_path,
        start_new_session=True,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    return proc, time.monotonic()


def _listens(pid: int, port: int) -> bool:
    """Whether ``pid`` or a process it started listens on TCP ``port`` (without connecting to it)."""
    try:
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for p in family:
        with contextlib.suppress(psutil.Error):
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                return True
    return False


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
    assert f"{endpoint} accepts connections but did not answer as a rendezvous store within 2 s" in final[0], out
    assert "free port" in final[0], out
    assert "Traceback" not in out, out
    assert not (tmp_path / "ran").exists()
    for p in psutil.process_iter(["cmdline"]):
        assert f"--rdzv-endpoint={endpoint}" not in " ".join(p.info["cmdline"] or []), "torchrun left behind"


def test_a_silent_endpoint_stops_a_launch_with_the_default_rdzv_timeout_within_the_store_answer_bound(
    tmp_path, silent_port
):
    """Without --rdzv-timeout (600 s), a held port is found by the store probe, not after ten minutes."""
    endpoint = f"127.0.0.1:{silent_port}"
    proc, started = _launch(tmp_path, "--rdzv-endpoint", endpoint, "--rdzv-id", "job")
    _end(proc, STORE_ANSWER_S + 30)
    took = time.monotonic() - started
    out = (tmp_path / "launch.log").read_text()
    assert proc.returncode != 0, out
    assert STORE_ANSWER_S <= took < STORE_ANSWER_S + 30, took
    final = [line for line in out.splitlines() if line.startswith("monai-fast launch: ")]
    assert final == [
        f"monai-fast launch: {endpoint} accepts connections but did not answer as a rendezvous store within "
        f"{STORE_ANSWER_S:g} s: another program holds that port; give --rdzv-endpoint a free port (or stop that "
        "program)"
    ], out
    assert "Traceback" not in out, out
    assert not (tmp_path / "ran").exists()
    for p in psutil.process_iter(["cmdline"]):
        assert f"--rdzv-endpoint={endpoint}" not in " ".join(p.info["cmdline"] or []), "torchrun left behind"


def test_the_store_probe_passes_a_real_store_and_a_free_port_and_names_a_program_that_answers_otherwise():
    spec = partial(LaunchSpec, nproc=1, nnodes=2, rdzv_id="j")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # what a host node's torchrun runs
    assert unanswered_endpoint_message(spec(rdzv_endpoint=f"127.0.0.1:{store.port}"), answer_s=5) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # closed again: the host node has not started yet
    assert unanswered_endpoint_message(spec(rdzv_endpoint=f"127.0.0.1:{free}"), answer_s=5) is None

    with socket.create_server(("127.0.0.1", 0)) as web:  # a program that answers every request and hangs up

        def answer() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = web.accept()
                    with conn:
                        conn.recv(1024)
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        endpoint = f"127.0.0.1:{web.getsockname()[1]}"
        message = unanswered_endpoint_message(spec(rdzv_endpoint=endpoint), answer_s=2)
    assert message is not None and message.startswith(f"{endpoint} accepts connections but "), message
    assert message.endswith("another program holds that port; give --rdzv-endpoint a free port (or stop that program)")


def test_sigterm_at_a_rendezvous_waiting_for_a_second_node_ends_the_launch_in_seconds(tmp_path):
    """No rank has started, so there is nothing to checkpoint: the --grace-s wait (120 s) does not apply.

    The endpoint is free, so this node's torchrun hosts the rendezvous and waits for the other node.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    proc, _ = _launch(tmp_path, "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", "j", "--rdzv-timeout", "300")
    deadline = time.monotonic() + 60
    while "waiting for the rendezvous" not in (tmp_path / "launch.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
        time.sleep(0.1)
    port = int(endpoint.rsplit(":", 1)[1])
    while not _listens(proc.pid, port):  # torchrun now hosts the store and waits there
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
        time.sleep(0.1)
    assert any(f"--rdzv-endpoint={endpoint}" in " ".join(p.cmdline()) for p in psutil.Process(proc.pid).children())
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
    from monai_fast.apps.cli import main

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["launch", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--rdzv-timeout", "0", str(script)])
    assert "--rdzv-timeout must be > 0 seconds, got 0" in str(e.value)
