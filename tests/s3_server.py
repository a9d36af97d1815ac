"""A real S3-compatible server for the remote-data tests: moto's S3 app served on 127.0.0.1.

It is what ``moto.server.ThreadedMotoServer`` runs (moto's WSGI app under werkzeug, in a thread,
here on a free port), with a thin WSGI layer in front that logs every request (method, path) and
can drop the connection of a GET after a given number of body bytes, as a network fault would.
A test module imports the fixtures ``server`` (module scope) and ``s3`` (a fresh bucket, the
``AWS_*`` variables pointing at the server) with
``from s3_server import s3_fixture, server_fixture  # noqa: F401``.

Example:
    >>> server = S3Server().start()
    >>> server.cut["/bucket/big.bin"] = 1024     # GETs of that object break after 1 KiB
    >>> server.gets("/bucket/big.bin")           # how many GETs reached it
    0
    >>> server.stop()
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator

import pytest

boto3 = pytest.importorskip("boto3", reason="S3 tests need the dev extra: pip install -e '.[dev]'")
s3fs = pytest.importorskip("s3fs", reason="S3 tests need the dev extra: pip install -e '.[dev]'")
pytest.importorskip("moto", reason="S3 tests need the dev extra: pip install -e '.[dev]'")
from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

__all__ = ["S3Server", "s3_fixture", "server_fixture"]


class S3Server:
    """moto's S3 on ``127.0.0.1:<free port>``; ``url`` is its endpoint, ``requests`` its log."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.cut: dict[str, int] = {}
        self._lock = threading.Lock()
        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, self._wrap(app), threaded=True, request_handler=MotoRequestHandler)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto-s3", daemon=True)

    def start(self) -> S3Server:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=30)
        self._server.server_close()

    def gets(self, path: str) -> int:
        """GET requests (downloads, whole or ranged) that reached ``path`` (``/bucket/key``)."""
        with self._lock:
            return sum(1 for m, p in self.requests if m == "GET" and p == path)

    def _wrap(self, app):
        def wsgi(environ, start_response):
            method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
            with self._lock:
                self.requests.append((method, path))
            body = app(environ, start_response)
            limit = self.cut.get(path) if method == "GET" else None
            return body if limit is None else _dropped_after(body, limit, environ["werkzeug.socket"])

        return wsgi


def _dropped_after(body: Iterable[bytes], limit: int, sock: socket.socket) -> Iterator[bytes]:
    """Send the first ``limit`` bytes of ``body``, then shut the connection (the client sees it drop)."""
    sent = 0
    for chunk in body:
        part = chunk[: max(0, limit - sent)]
        if part:
            yield part
            sent += len(part)
        if sent >= limit:
            break
    with contextlib.suppress(AttributeError):
        body.close()  # type: ignore[attr-defined]
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture(scope="module", name="server")
def server_fixture():
    """``server``: one per test module that imports this fixture."""
    s = S3Server().start()
    yield s
    s.stop()


@pytest.fixture(name="s3")
def s3_fixture(server, monkeypatch, tmp_path):
    """``s3``: ``(boto3 client, fresh bucket name)``; the AWS variables a user would set point at ``server``."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    s3fs.S3FileSystem.clear_instance_cache()  # an instance made for another server's endpoint
    client = boto3.client("s3")
    bucket = f"b-{uuid.uuid4().hex[:12]}"  # moto's buckets live as long as the process: one per test
    client.create_bucket(Bucket=bucket)
    yield client, bucket
    s3fs.S3FileSystem.clear_instance_cache()
