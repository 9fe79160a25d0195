"""The segment holder: a pool that outlives the engine processes that filled it."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvcore.errors import ConfigError
from kvcore.ports import StoreItem
from kvcore.testing.support import fresh_keys, payload
from kvcore_mooncake import MooncakeChunkStore
from kvcore_mooncake.holder import parse_config
from tests.mooncake.conftest import Master, config_for, free_port


def start_holder(master: str, *extra: str, stdout: int = subprocess.PIPE) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvcore_mooncake.holder", "--master", master, *extra],
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )


@pytest.fixture
def holder(master: Master) -> Iterator[subprocess.Popen[str]]:
    process = start_holder(master.address, "--segment-size", "32MiB")
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 20)
        assert ready, "the holder printed nothing within 20 s"
        assert process.stdout.readline().startswith("ready ")
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
