"""``SlowLink``: a TCP proxy on loopback in front of a real server that delays every byte by a set time in
each direction, or holds every byte (frozen) — a slow or silent network between an engine and its store,
injected out of band: neither side is changed or knows.

Bytes keep their order and their pipelining (a byte sent at ``t`` arrives at ``t + delay_s`` whatever was
sent before it), so a request/response protocol sees ``2 * delay_s`` more per round trip and a stream its
full rate after the first delay. Each accepted connection gets its own connection upstream; closing either
side closes the other once what it sent has been delivered.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time

__all__ = ["SlowLink"]

log = logging.getLogger(__name__)

_READ = 1 << 16
_JOIN_S = 5.0


class _Pipe:
    """One direction of one connection: a reader queueing bytes with their due time, a writer sending
    them once due."""

    def __init__(self, link: SlowLink, src: socket.socket, dst: socket.socket, name: str) -> None:
        self._link, self._src, self._dst = link, src, dst
        self._queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self._cond = threading.Condition()
        self.threads = (
            threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
            threading.Thread(target=self._write, name=f"{name}-write", daemon=True),
        )
        for thread in self.threads:
            thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = self._src.recv(_READ)
            except OSError:
                data = b""
            with self._cond:
                self._queue.append((time.monotonic() + self._link.delay_s, data or None))
                self._cond.notify()
            if not data:
                return

    def _write(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._link.closed:
                        return
                    wait = self._queue[0][0] - time.monotonic() if self._queue else None
                    if wait is not None and wait <= 0 and not self._link.frozen:
                        _, data = self._queue.popleft()
                        break
                    self._cond.wait(0.05 if wait is None or self._link.frozen else min(wait, 0.05))
            if data is None:
                with contextlib.suppress(OSError):
                    self._dst.shutdown(socket.SHUT_WR)
                return
            try:
                self._dst.sendall(data)
            except OSError:
                return


class SlowLink:
    """Listens on ``127.0.0.1`` (``address``) and forwards each connection to ``upstream`` with
    ``delay_s`` added each way. ``frozen``: bytes are held (not dropped) until it is cleared. ``close``
    stops accepting and closes every connection; use it as a context manager.
    """

    def __init__(self, upstream: tuple[str, int], delay_s: float = 0.0) -> None:
        if not 0 <= delay_s < 3600:
            raise ValueError(f"delay_s: got {delay_s!r}, expected seconds in [0, 3600)")
        self.upstream = upstream
        self.delay_s = delay_s
        self.frozen = False
        self._closing = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.05)  # the acceptor sees ``closed`` within that
        self._sockets: list[socket.socket] = []
        self._pipes: list[_Pipe] = []
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept, name="slow-link-accept", daemon=True)
        self._acceptor.start()

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.getsockname()[:2]
        return str(host), int(port)

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.upstream, timeout=5.0)
                upstream.settimeout(None)
            except OSError as exc:
                log.warning("slow link: upstream %s: %s", self.upstream, exc)
                client.close()
                continue
            with self._lock:
                if self._closing.is_set():
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
                n = len(self._pipes)
                self._pipes += [
                    _Pipe(self, client, upstream, f"slow-link-{n}-up"),
                    _Pipe(self, upstream, client, f"slow-link-{n}-down"),
                ]

    def close(self) -> None:
        with self._lock:
            self._closing.set()
            sockets, pipes = list(self._sockets), list(self._pipes)
        with contextlib.suppress(OSError):
            self._server.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in [self._acceptor, *(t for pipe in pipes for t in pipe.threads)]:
            thread.join(_JOIN_S)

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
