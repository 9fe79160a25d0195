"""A real ``lmcache server`` on loopback for the LMCache backend's tests, and a way to kill and restart it.

Telemetry is off, metrics are off, the HTTP API binds to 127.0.0.1, the shared-memory segment has a
name unique to the test session, and ports are free ones picked at start. The server runs in its own
process group and is stopped by that group's id.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# lmcache 0.5.6 builds an OpenTelemetry logging handler at import that warns of its own deprecation;
# the suite runs with warnings as errors, so take the import here, once, with that warning ignored.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import lmcache.v1.multiprocess.transport.zmq_impl.client  # noqa: F401  (imported lazily by create)
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    import kvcore_lmcache  # noqa: F401  (its lmcache imports, under this filter)

CHUNK_TOKENS = 16
READY_S = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _lmcache_cli() -> str:
    found = shutil.which("lmcache", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("the `lmcache` command is not installed next to this interpreter")
    return found


class LMCacheServer:
    """One ``lmcache server`` process: ``start``, ``kill`` (SIGKILL to its group) and ``restart``."""

    def __init__(self, log_dir: Path, chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.port = _free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.chunk_tokens = chunk_tokens
        self.shm_name = f"kvcore_test_{uuid.uuid4().hex[:10]}"
        self._log_dir = log_dir
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
        command = [
            _lmcache_cli(), "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--chunk-size", str(self.chunk_tokens), "--l1-size-gb", "0.05", "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto", "--shm-name", self.shm_name, "--disable-metrics",
            "--http-host", "127.0.0.1", "--http-port", str(_free_port()), "--max-workers", "1",
        ]  # fmt: skip
        log = (self._log_dir / f"lmcache-{self.port}.log").open("ab")
        self._process = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        client = RequestClientFactory.create(self.url)
        try:
            deadline = time.monotonic() + READY_S
            while time.monotonic() < deadline:
                if self._process is not None and self._process.poll() is not None:
                    raise RuntimeError(f"lmcache server exited with {self._process.returncode}")
                try:
                    if client.get_chunk_size().result(timeout=0.5) == self.chunk_tokens:
                        return
                except TimeoutError:
                    continue
            raise RuntimeError(f"lmcache server on {self.url} not ready after {READY_S}s")
        finally:
            client.close()

    def kill(self) -> None:
        if self._process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait(10)
        self._process = None
        Path("/dev/shm", f"lmcache_l1_pool_{self.shm_name}").unlink(missing_ok=True)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): it accepts requests and answers none, as after an error."""
        if self._process is not None:
            os.killpg(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._process is not None:
            os.killpg(self._process.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()


@pytest.fixture(scope="module")
def lmcache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    """One server per test module (a start takes several seconds)."""
    server = LMCacheServer(tmp_path_factory.mktemp("lmcache"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[int], LMCacheServer]]:
    """Servers (not yet started) for one test, each killed at its end: ``factory(chunk_tokens)``."""
    made: list[LMCacheServer] = []

    def make(chunk_tokens: int = CHUNK_TOKENS) -> LMCacheServer:
        server = LMCacheServer(tmp_path_factory.mktemp("lmcache"), chunk_tokens)
        made.append(server)
        return server

    try:
        yield make
    finally:
        for server in made:
            server.kill()
