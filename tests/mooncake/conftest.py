"""Fixtures for the Mooncake tests: real ``mooncake_master`` processes on loopback, and configs for them.

Every test here runs only inside a loopback-only network namespace (Mooncake clients listen on every
interface): the session fixture below skips them all elsewhere. Masters get random free ports and a
short lease TTL (reads block ``remove`` only briefly); each is stopped by its pid, dies with the test
process even when that is SIGKILLed (``start_owned``), and has stopped by the session's end (checked).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcore.kit.settings import ByteCount, ByteSize
from kvcore.testing.support import start_owned
from kvcore_mooncake.config import MooncakeStoreConfig
from tests.netns import require_loopback_namespace

MASTER_BIN = Path(sys.executable).parent / "mooncake_master"
LEASE_MS = 1000  # long enough for a read on a loaded machine (200 ms expired mid-read under make test)
MiB = 1 << 20


PD_TRANSFER_TIMEOUT_S = 120
"""Mooncake's own bound on a transfer (``MC_TRANSFER_TIMEOUT``, 30 s by default) for the P/D engines the
tests start: their writes share two cores with the other lane's engines, and one starved for 30 s failed
a test that checks bytes, not timeouts (a failed write is its own test: ``tests/mooncake_pd``)."""


@contextlib.contextmanager
def patient_transfers() -> Iterator[None]:
    """While engines start (their workers read it then): ``MC_TRANSFER_TIMEOUT`` of
    ``PD_TRANSFER_TIMEOUT_S``, unless the environment sets one."""
    if "MC_TRANSFER_TIMEOUT" in os.environ:
        yield
        return
    os.environ["MC_TRANSFER_TIMEOUT"] = str(PD_TRANSFER_TIMEOUT_S)
    try:
        yield
    finally:
        del os.environ["MC_TRANSFER_TIMEOUT"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Master:
    """One ``mooncake_master`` on 127.0.0.1 that a test can kill and restart on the same port; every
    process it starts is added to ``started``."""

    def __init__(self, log_dir: Path, flags: tuple[str, ...], started: list[subprocess.Popen[bytes]]) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.flags = flags
        self.log = log_dir / f"master-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._started = started

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it (from the main thread: see ``start_owned``) and wait (at most 10 s) until its RPC port
        accepts connections."""
        with self.log.open("ab") as log:
            self.process = start_owned(
                [
                    str(MASTER_BIN),
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={self.port}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                    f"--default_kv_lease_ttl={LEASE_MS}",
                    "--client_ttl=2",
                    "--logtostderr",
                    *self.flags,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._started.append(self.process)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"mooncake_master did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL by pid, as a crash would; idempotent."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL after 5 s; idempotent."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None


MasterFactory = Callable[..., Master]


@pytest.fixture(autouse=True, scope="session")
def _loopback_only() -> None:
    require_loopback_namespace()


class Masters:
    """The session's masters: where they log, and every process they started."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def new(self, flags: tuple[str, ...]) -> Master:
        return Master(self.log_dir, flags, self.started)


@pytest.fixture(scope="session")
def _masters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Masters]:
    """Torn down after every fixture that starts a master: none of their processes may still run."""
    masters = Masters(tmp_path_factory.mktemp("mooncake"))
    yield masters
    running = [process.args for process in masters.started if process.poll() is None]
    assert not running, f"mooncake masters outlived the test session: {running}"


@pytest.fixture
def master_factory(_masters: Masters) -> Iterator[MasterFactory]:
    """``make(*flags)`` starts a master of this test's own; all are stopped after the test."""
    masters: list[Master] = []

    def make(*flags: str) -> Master:
        master = _masters.new(flags)
        masters.append(master)
        master.start()
        return master

    yield make
    for master in masters:
        master.stop()


@pytest.fixture(scope="session")
def master(_masters: Masters) -> Iterator[Master]:
    """A master shared by the tests that do not kill it (keys are fresh per test)."""
    shared = _masters.new(())
    shared.start()
    yield shared
    shared.stop()


def config_for(master: str, segment_size: int = 0, setup_timeout_s: float = 5.0) -> MooncakeStoreConfig:
    """A client config for the master at ``master``: loopback, a small transfer buffer, short bounds."""
    return MooncakeStoreConfig(
        master=master,
        segment_size=ByteCount(segment_size),
        transfer_buffer_size=ByteSize(16 * MiB),
        setup_timeout_s=setup_timeout_s,
        rpc_timeout_s=2.0,
    )


@contextlib.contextmanager
def own_store(masters: Masters) -> Iterator[Master]:
    """A master of the caller's own (every key in it is the caller's) and a segment holder on it, where
    the store's memory lives (an engine's workers are then pure clients); both stopped after."""
    master = masters.new(())
    master.start()
    try:
        holder = _segment_holder(master.address)
        try:
            yield master
        finally:
            holder.terminate()
            holder.wait(30)
    finally:
        master.stop()


def stored_keys(master: Master) -> tuple[str, ...]:
    """Every key the master knows (its HTTP metrics server lists them)."""
    url = f"http://127.0.0.1:{master.metrics_port}/get_all_keys"
    with urllib.request.urlopen(url, timeout=10) as answer:
        return tuple(answer.read().decode().split())


def _segment_holder(master: str) -> subprocess.Popen[str]:
    proc: subprocess.Popen[str] = start_owned(
        [sys.executable, "-m", "kvcore_mooncake.holder", "--master", master, "--segment-size", "64MiB"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        proc.wait(30)
        pytest.fail(f"segment holder did not start: {line!r}")
    return proc
