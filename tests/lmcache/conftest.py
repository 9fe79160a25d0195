"""Real ``lmcache server`` processes on loopback for the LMCache backend's tests.

Telemetry is off, metrics are off, the HTTP API binds to 127.0.0.1, each server's shared-memory segment
has a unique name, and ports are free ones picked at start. Servers are forked from one warm launcher
(``launcher.py``): a server starts in under a second instead of 15-25 s, so a test that kills,
freezes or restarts a server gets its own, and every other test shares one session server with fresh
keys. Each server runs in its own process group and is stopped by that group's id.

The launcher and every server die with the test process (``start_owned``), even a SIGKILLed one; at
the session's end the launcher's fixture checks that none of them is still running.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import pytest

from kvcore.testing.support import process_started, running, start_owned
from tests.frozen import freeze, thaw

if TYPE_CHECKING:
    from tests.lmcache.direct_rig import EngineFactory

# lmcache 0.5.6 builds an OpenTelemetry logging handler at import that warns of its own deprecation;
# the suite runs with warnings as errors, so take the import here, once, with that warning ignored.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import lmcache.v1.multiprocess.transport.zmq_impl.client  # noqa: F401  (imported lazily by create)
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    import kvcore_lmcache  # noqa: F401  (its lmcache imports, under this filter)

CHUNK_TOKENS = 128
"""The shared server's chunk size: one vLLM CPU block, so the engine tests can use it too."""
L1_GB = 0.05
WARM_S = 90.0
READY_S = 15.0
GONE_S = 10.0
SERVER_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _read_line(stream: IO[str], timeout: float, what: str) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise RuntimeError(f"{what}: no answer within {timeout}s")
    line = stream.readline()
    if not line:
        raise RuntimeError(f"{what}: the launcher exited")
    return line.strip()


class Launcher:
    """The warm launcher process: ``spawn(argv, log)`` forks a server and returns its pid.

    Start it from the main thread: it dies with the thread that started it (``start_owned``), and the
    servers it forks die with it.
    """

    def __init__(self, log_dir: Path) -> None:
        with (log_dir / "launcher.log").open("ab") as log:
            self._process: subprocess.Popen[str] = start_owned(
                [sys.executable, str(Path(__file__).with_name("launcher.py"))],
                env=dict(os.environ, **SERVER_ENV),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                process_group=0,  # not a session: see launcher.py on scheduling groups
            )
        self.pid = self._process.pid
        # every process it started, with its start time (pids are reused): see ``running_processes``
        self._started: list[tuple[int, int | None]] = [(self.pid, process_started(self.pid))]
        assert self._process.stdin is not None
        assert self._process.stdout is not None
        self._stdin, self._stdout = self._process.stdin, self._process.stdout
        try:
            ready = _read_line(self._stdout, WARM_S, "lmcache launcher start")
        except RuntimeError:
            self.close()
            raise
        if ready != "ready":
            self.close()
            raise RuntimeError(f"lmcache launcher said {ready!r}")

    def spawn(self, argv: list[str], log: Path) -> int:
        self._stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self._stdin.flush()
        pid = int(_read_line(self._stdout, READY_S, "lmcache launcher fork"))
        self._started.append((pid, process_started(pid)))
        return pid

    def running_processes(self, within: float = GONE_S) -> list[int]:
        """The launcher and the servers it forked that still run after at most ``within`` seconds."""
        deadline = time.monotonic() + within
        while (left := [pid for pid, started in self._started if running(pid, started)]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.01)
        return left

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait(GONE_S)
        self._stdout.close()


class LMCacheServer:
    """One ``lmcache server``: ``start``, ``kill`` (SIGKILL to its group), ``pause``/``resume``, ``restart``.

    A restart keeps the URL and the shared-memory name, as an operator restarting the service would.
    ``shm_name`` is ``None`` for a server started without ``--shm-name`` (no shared-memory pool); it may
    be changed before a (re)start.
    """

    def __init__(
        self,
        launcher: Launcher,
        log_dir: Path,
        chunk_tokens: int = CHUNK_TOKENS,
        *,
        shared_memory: bool = True,
        options: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.chunk_tokens = chunk_tokens
        self.shm_name = new_shm_name() if shared_memory else None
        self.options = tuple(options)
        self._launcher = launcher
        self.log = log_dir / f"lmcache-{self.port}.log"
        self.http_port = 0
        self.pid: int | None = None

    def start(self) -> None:
        self.http_port = free_port()
        argv = [
            "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--chunk-size", str(self.chunk_tokens), "--l1-size-gb", str(L1_GB), "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto", "--disable-metrics",
            "--http-host", "127.0.0.1", "--http-port", str(self.http_port), "--max-workers", "1",
        ]  # fmt: skip
        if self.shm_name is not None:
            argv += ["--shm-name", self.shm_name]
        argv += self.options
        self.pid = self._launcher.spawn(argv, self.log)
        self._wait_ready()

    def _wait_ready(self) -> None:
        client = RequestClientFactory.create(self.url)
        try:
            deadline = time.monotonic() + READY_S
            while time.monotonic() < deadline:
                if self.pid is None or not running(self.pid):
                    raise RuntimeError(f"lmcache server exited; see {self.log}")
                try:
                    if client.get_chunk_size().result(timeout=0.5) == self.chunk_tokens:
                        return
                except TimeoutError:
                    continue
            raise RuntimeError(f"lmcache server on {self.url} not ready after {READY_S}s; see {self.log}")
        finally:
            client.close()

    def registered(self) -> list[int]:
        """The instance ids of the workers whose (engine-driven) registration the server holds."""
        return [int(i) for i in self.status()["registered_non_cuda_instance_ids"]]

    def read_locked(self) -> int:
        """How many of the server's cached chunks are read-locked now."""
        return int(self.status()["storage_manager"]["l1_manager"]["read_locked_count"])

    def objects(self) -> int:
        """How many chunks (values) the server holds now."""
        return int(self.status()["storage_manager"]["l1_manager"]["total_object_count"])

    def status(self) -> dict[str, Any]:
        """The server's HTTP status (which may come up shortly after the server answers requests)."""
        deadline = time.monotonic() + READY_S
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.http_port}/status", timeout=READY_S
                ) as reply:
                    status: dict[str, Any] = json.load(reply)
                    return status
            except urllib.error.URLError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would; returns once the process is gone. Idempotent."""
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + GONE_S
        while running(self.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.pid = None
        if self.shm_name is not None:
            Path("/dev/shm", f"lmcache_l1_pool_{self.shm_name}").unlink(missing_ok=True)

    def pause(self) -> None:
        """Freeze the server (``tests.frozen``): it accepts requests and answers none, as after an error."""
        if self.pid is not None:
            freeze(self.pid, group=True)

    def resume(self) -> None:
        if self.pid is not None:
            thaw(self.pid, group=True)

    def restart(self) -> None:
        self.kill()
        self.start()


def new_shm_name() -> str:
    """A shared-memory name no other server uses."""
    return f"kvcore_test_{uuid.uuid4().hex[:10]}"


class ServerFactory(Protocol):
    """``server_factory``: servers (not yet started) of one test."""

    def __call__(
        self, chunk_tokens: int = CHUNK_TOKENS, *, shared_memory: bool = True, options: Sequence[str] = ()
    ) -> LMCacheServer: ...


@pytest.fixture(scope="session")
def lmcache_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """The session's launcher; at the end, it and every server it started must have stopped."""
    launcher = Launcher(tmp_path_factory.mktemp("lmcache-launcher"))
    try:
        yield launcher
    finally:
        launcher.close()
    survivors = launcher.running_processes()
    assert not survivors, f"lmcache processes outlived the test session: {survivors}"


@pytest.fixture(scope="session")
def lmcache_server(
    lmcache_launcher: Launcher, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LMCacheServer]:
    """One server for every test that leaves it running; tests keep apart by fresh keys or models."""
    server = LMCacheServer(lmcache_launcher, tmp_path_factory.mktemp("lmcache"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def server_factory(
    lmcache_launcher: Launcher, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerFactory]:
    """Servers (not yet started) of one test, killed at its end: ``factory(chunk_tokens)``;
    ``shared_memory=False`` leaves out ``--shm-name``; ``options`` are more server arguments."""
    made: list[LMCacheServer] = []
    log_dir = tmp_path_factory.mktemp("lmcache")

    def make(
        chunk_tokens: int = CHUNK_TOKENS, *, shared_memory: bool = True, options: Sequence[str] = ()
    ) -> LMCacheServer:
        server = LMCacheServer(
            lmcache_launcher, log_dir, chunk_tokens, shared_memory=shared_memory, options=options
        )
        made.append(server)
        return server

    try:
        yield make
    finally:
        for server in made:
            server.kill()


@pytest.fixture
def engines(lmcache_server: LMCacheServer) -> Iterator[EngineFactory]:
    """Engines stepped by hand (``direct_rig``), on the shared server unless told another."""
    from tests.lmcache.direct_rig import engine_factory  # it imports this module

    with engine_factory(lmcache_server) as make:
        yield make
