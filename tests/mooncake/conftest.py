"""Fixtures for the Mooncake tests: real ``mooncake_master`` processes on loopback, and configs for them.

Every test here runs only inside a loopback-only network namespace (Mooncake clients listen on every
interface): the session fixture below skips them all elsewhere. Masters get random free ports and a
short lease TTL (reads block ``remove`` only briefly); each is stopped by its pid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcore.config import ByteCount, ByteSize, MooncakeStoreConfig
from tests.netns import require_loopback_namespace

MASTER_BIN = Path(sys.executable).parent / "mooncake_master"
LEASE_MS = 200
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Master:
    """One ``mooncake_master`` on 127.0.0.1 that a test can kill and restart on the same port."""

    def __init__(self, log_dir: Path, flags: tuple[str, ...]) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.flags = flags
        self.log = log_dir / f"master-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start it and wait (at most 10 s) until its RPC port accepts connections."""
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
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


@pytest.fixture(scope="session")
def _master_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mooncake")


@pytest.fixture
def master_factory(_master_logs: Path) -> Iterator[MasterFactory]:
    """``make(*flags)`` starts a master of this test's own; all are stopped after the test."""
    masters: list[Master] = []

    def make(*flags: str) -> Master:
        master = Master(_master_logs, flags)
        masters.append(master)
        master.start()
        return master

    yield make
    for master in masters:
        master.stop()


@pytest.fixture(scope="session")
def master(_master_logs: Path) -> Iterator[Master]:
    """A master shared by the tests that do not kill it (keys are fresh per test)."""
    shared = Master(_master_logs, ())
    shared.start()
    yield shared
    shared.stop()


def config_for(master: str, segment_size: int = 0, setup_timeout_s: float = 5.0) -> MooncakeStoreConfig:
    """A client config for the master at ``master``: loopback, a small transfer buffer, a short bound."""
    return MooncakeStoreConfig(
        master=master,
        segment_size=ByteCount(segment_size),
        transfer_buffer_size=ByteSize(16 * MiB),
        setup_timeout_s=setup_timeout_s,
    )
