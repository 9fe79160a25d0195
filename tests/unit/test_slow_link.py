"""``SlowLink`` in front of a real TCP echo server: delays each way, holds bytes while frozen, keeps order,
and closes every thread it started."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvcore.testing.slow_link import SlowLink


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5.0)

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[:2]
    thread.join(5.0)
    server.close()


def _round_trip(sock: socket.socket, data: bytes) -> float:
    started = time.monotonic()
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        got += sock.recv(4096)
    assert got == data
    return time.monotonic() - started


def test_a_round_trip_takes_twice_the_delay_and_bytes_keep_their_order(echo: tuple[str, int]) -> None:
    before = threading.active_count()
    with SlowLink(echo, delay_s=0.1) as link, socket.create_connection(link.address, timeout=5.0) as sock:
        assert 0.2 <= _round_trip(sock, b"ping") < 1.0
        link.delay_s = 0.0
        assert _round_trip(sock, bytes(range(256)) * 64) < 0.5
    time.sleep(0.1)
    assert threading.active_count() <= before + 1  # the echo server's own thread, ending


def test_a_frozen_link_holds_bytes_until_thawed(echo: tuple[str, int]) -> None:
    with SlowLink(echo) as link, socket.create_connection(link.address, timeout=5.0) as sock:
        link.frozen = True
        sock.sendall(b"held")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(4)
        link.frozen = False
        sock.settimeout(5.0)
        assert sock.recv(4) == b"held"


def test_a_bad_delay_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="delay_s"):
        SlowLink(("127.0.0.1", 1), delay_s=-1)
