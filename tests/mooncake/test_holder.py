"""The segment holder: a pool that outlives the engine processes that filled it, and a holder a test
starts dies with the test process."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import IO

import pytest

from kvcore.errors import ConfigError
from kvcore.ports import StoreItem
from kvcore.testing.support import fresh_keys, payload, process_started, running, start_owned
from kvcore_mooncake import MooncakeChunkStore
from kvcore_mooncake.holder import parse_config
from tests.mooncake.conftest import Master, config_for, free_port

READY_S = 20.0
GONE_S = 5.0

OWNER = """
import subprocess, sys
from kvcore.testing.support import start_owned
holder = start_owned(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
print(holder.pid, holder.stdout.readline().strip(), flush=True)  # one line, even if it printed none
sys.stdin.read()  # until killed
"""
"""An owner process: starts a holder (the command in its arguments) the way tests do, prints its pid
and its first line ("ready ..." once it holds its segment), then waits."""


def holder_argv(master: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvcore_mooncake.holder", "--master", master, *extra]


def start_holder(master: str, *extra: str, stdout: int = subprocess.PIPE) -> subprocess.Popen[str]:
    return start_owned(
        holder_argv(master, *extra),
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )


def read_line(stream: IO[str] | None, what: str) -> str:
    """The next line a child prints, waited for at most ``READY_S``."""
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], READY_S)
    assert ready, f"{what} printed nothing within {READY_S} s"
    return stream.readline()


@pytest.fixture
def holder(master: Master) -> Iterator[subprocess.Popen[str]]:
    process = start_holder(master.address, "--segment-size", "32MiB")
    try:
        assert read_line(process.stdout, "the holder").startswith("ready ")
        yield process
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def test_parse_config_validates_through_the_core() -> None:
    config = parse_config(["--master", "127.0.0.1:1", "--segment-size", "4GiB"])
    assert config.segment_size == 4 << 30
    with pytest.raises(ConfigError, match="segment_size"):
        parse_config(["--segment-size", "lots"])
    with pytest.raises(ConfigError, match="segment_size"):
        parse_config(["--segment-size", "0"])


def test_unreachable_master_exits_2_at_once() -> None:
    start = time.monotonic()
    process = start_holder(f"127.0.0.1:{free_port()}", "--segment-size", "1MiB", stdout=subprocess.DEVNULL)
    assert process.wait(20) == 2
    assert time.monotonic() - start < 20


def test_pool_outlives_the_engine_and_sigterm_stops_the_holder(
    master: Master, holder: subprocess.Popen[str]
) -> None:
    # engine 1 (a pure client) stores, then exits; engine 2 reads the value back from the holder
    memory = ctypes.create_string_buffer(8192)
    address = ctypes.addressof(memory)
    (key,) = fresh_keys(1)
    value = payload(4096, key)
    ctypes.memmove(address, value, len(value))
    engine = MooncakeChunkStore.open(config_for(master.address), address, 8192)
    try:
        (result,) = engine.wait([engine.submit_put([StoreItem(key, 0, 4096)])], 5)
        assert result.ok
    finally:
        engine.close()
    engine = MooncakeChunkStore.open(config_for(master.address), address, 8192)
    try:
        (result,) = engine.wait([engine.submit_get([StoreItem(key, 4096, 4096)])], 5)
        assert result.ok
        assert ctypes.string_at(address + 4096, 4096) == value
    finally:
        engine.close()
    os.kill(holder.pid, signal.SIGTERM)
    assert holder.wait(15) == 0


def test_a_holder_dies_with_its_killed_owner(master: Master) -> None:
    owner: subprocess.Popen[str] = start_owned(
        [sys.executable, "-c", OWNER, *holder_argv(master.address, "--segment-size", "32MiB")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    holder = 0
    try:
        pid, said = read_line(owner.stdout, "the owner").split(" ", 1)
        holder = int(pid)
        started = process_started(holder)
        assert said.startswith("ready ")
        assert running(holder, started)

        os.kill(owner.pid, signal.SIGKILL)  # no clean-up code of the owner runs
        assert owner.wait(GONE_S) == -signal.SIGKILL  # reaped: it was our child
        deadline = time.monotonic() + GONE_S
        while running(holder, started):  # a zombie counts as gone: its new parent reaps it
            assert time.monotonic() < deadline, f"holder {holder} outlived its owner by {GONE_S}s"
            time.sleep(0.01)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(GONE_S)
        if holder and running(holder):
            os.kill(holder, signal.SIGKILL)
        for stream in (owner.stdin, owner.stdout):
            if stream is not None:
                stream.close()
