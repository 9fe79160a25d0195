"""A killed owner leaves no LMCache server behind.

The tests' launcher is a small Python owner that forks real ``lmcache server`` processes. A launcher of
this test's own (the session's serves the other tests) starts a server; then the launcher is SIGKILLed,
so none of its clean-up code runs, and the server, and every process of its process group (the server
starts a resource tracker of its own), must be gone within seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from kvcore.testing.support import running
from tests.lmcache.conftest import GONE_S, Launcher, LMCacheServer


def _group(pgid: int) -> list[int]:
    """The running processes of process group ``pgid``."""
    members: list[int] = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                if os.getpgid(int(entry.name)) == pgid and running(int(entry.name)):
                    members.append(int(entry.name))
    return members


def test_a_server_dies_with_its_killed_launcher(tmp_path_factory: pytest.TempPathFactory) -> None:
    log_dir = tmp_path_factory.mktemp("orphans")
    launcher = Launcher(log_dir)
    server = LMCacheServer(launcher, log_dir)
    try:
        server.start()  # answers requests: a real, running server
        assert server.pid is not None
        pid = server.pid
        assert pid in _group(pid)

        os.kill(launcher.pid, signal.SIGKILL)
        assert launcher.running_processes() == []  # the launcher (reaped by close) and its server
        deadline = time.monotonic() + GONE_S
        while left := _group(pid):
            assert time.monotonic() < deadline, f"processes {left} of server {pid} outlived its owner"
            time.sleep(0.01)
    finally:
        launcher.close()  # reaps the launcher; kills what is left otherwise
        server.kill()  # removes the shared-memory segment
