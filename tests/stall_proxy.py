"""A real TCP proxy on 127.0.0.1 that stalls or throttles the responses to GETs of chosen paths.

It sits in front of a server (the moto S3 server of ``tests/s3_server.py``) and forwards bytes both
ways unchanged, except on a connection whose client has sent ``GET <path>`` for a path in
``rules``: from then on the response bytes follow that rule, as a broken network or an overloaded
server would deliver them.

- ``Stall(after)``: the first ``after`` bytes pass, then nothing more is sent while the socket
  stays open (a server that stops sending mid-body).
- ``Throttle(chunk, every)``: ``chunk`` bytes are sent every ``every`` seconds (a slow link).

HTTP/1.1 clients wait for a response before they send the next request on a connection, so the
response bytes that follow a matching request line are that request's response.

Example:
    >>> proxy = StallProxy("127.0.0.1", 9000).start()
    >>> proxy.rules["/bucket/big.bin"] = Stall(after=256 << 10)
    >>> proxy.url
    'http://127.0.0.1:...'
    >>> proxy.stop()
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from dataclasses import dataclass

__all__ = ["Stall", "StallProxy", "Throttle"]

_POLL = 0.1
_REQUEST = re.compile(rb"(?:^|\r\n)GET (\S+) HTTP/1\.[01]\r\n")


@dataclass(frozen=True)
class Stall:
    """Send the first ``after`` bytes of the response, then nothing (the socket stays open)."""

    after: int


@dataclass(frozen=True)
class Throttle:
    """Send the response ``chunk`` bytes at a time, one chunk every ``every`` seconds."""

    chunk: int
    every: float


class _Link:
    """One client connection and its connection to the server."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.rule: Stall | Throttle | None = None
        self.sent = 0


class StallProxy:
    """A proxy on ``127.0.0.1:<free port>`` to ``host:port``; ``url`` is its address, ``rules`` path -> rule."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.rules: dict[str, Stall | Throttle] = {}
        self.stalled = threading.Event()  # set when a Stall rule has held back a response
        self.matched: list[str] = []  # the paths whose GETs met a rule, in order
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL)  # the accept loop sees stop() within _POLL seconds
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, name="stall-proxy", daemon=True)

    def start(self) -> StallProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection (stalled clients see their connection drop)."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            link = _Link(client, upstream)
            threading.Thread(target=self._requests, args=(link,), daemon=True).start()
            threading.Thread(target=self._responses, args=(link,), daemon=True).start()

    def _requests(self, link: _Link) -> None:
        """Client -> server, unchanged; a GET of a path with a rule arms that rule for the response."""
        with contextlib.suppress(OSError):
            while data := link.client.recv(65536):
                for path in _REQUEST.findall(data):
                    rule = self.rules.get(path.decode("latin-1").split("?", 1)[0])
                    link.rule, link.sent = rule, 0
                    if rule is not None:
                        self.matched.append(path.decode("latin-1"))
                link.upstream.sendall(data)
        with contextlib.suppress(OSError):
            link.upstream.shutdown(socket.SHUT_WR)

    def _responses(self, link: _Link) -> None:
        """Server -> client, following the armed rule."""
        with contextlib.suppress(OSError):
            while data := link.upstream.recv(65536):
                rule = link.rule
                if isinstance(rule, Stall):
                    part = data[: max(0, rule.after - link.sent)]
                    if part:
                        link.client.sendall(part)
                        link.sent += len(part)
                    if link.sent >= rule.after:
                        self.stalled.set()
                        self._closing.wait()  # hold the connection open, silent, until the proxy stops
                        return
                elif isinstance(rule, Throttle):
                    for i in range(0, len(data), rule.chunk):
                        if self._closing.wait(rule.every):
                            return
                        link.client.sendall(data[i : i + rule.chunk])
                        link.sent += len(data[i : i + rule.chunk])
                else:
                    link.client.sendall(data)
        with contextlib.suppress(OSError):
            link.client.shutdown(socket.SHUT_WR)
