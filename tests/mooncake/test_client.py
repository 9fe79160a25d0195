"""The guarded client: no call reaches a closed native client, codes read as names, buffers register once."""

from __future__ import annotations

import ctypes
import time

import pytest

from kvcore.errors import BackendUnavailable, ConfigError, UsageError
from kvcore.ids import ChunkKey
from kvcore.ports import StoreItem
from kvcore_mooncake import MooncakeChunkIndex, MooncakeChunkStore, MooncakeClient
from kvcore_mooncake.client import describe
from tests.mooncake.conftest import Master, config_for

KEY = ChunkKey("kv/test/k")


def test_codes_are_described() -> None:
    assert describe(-704) == "-704 (not found)"
    assert describe(-900) == "-900 (master unreachable (RPC failed))"
    assert describe(-12345) == "-12345 (unknown code)"


def test_a_bad_master_address_names_the_field() -> None:
    with pytest.raises(ConfigError, match="master"):
        MooncakeClient.connect(config_for("no-port-here"))


def test_closed_client_refuses_every_call(master: Master) -> None:
    client = MooncakeClient.connect(config_for(master.address))
    start = time.monotonic()
    client.close()
    assert time.monotonic() - start < 3.0
    assert client.closed
    for call in (
        lambda: client.exist(["k"]),
        lambda: client.put_from(["k"], [0], [1]),
        lambda: client.get_into(["k"], [0], [1]),
        lambda: client.remove(["k"]),
        client.remove_all,
        lambda: client.register_buffer(0, 1),
    ):
        with pytest.raises(BackendUnavailable, match="closed"):
            call()
    client.close()  # idempotent


def test_store_and_index_after_close(master: Master) -> None:
    memory = ctypes.create_string_buffer(4096)
    client = MooncakeClient.connect(config_for(master.address))
    # two stores on one client and buffer: the second registration is a no-op, not Mooncake's -600
    first = MooncakeChunkStore(client, ctypes.addressof(memory), 4096)
    second = MooncakeChunkStore(client, ctypes.addressof(memory), 4096)
    index = MooncakeChunkIndex(client, timeout_s=1.0)
    for closeable in (first, second, index):
        closeable.close()
    with pytest.raises(UsageError, match="closed"):
        first.submit_put([StoreItem(KEY, 0, 1)])
    with pytest.raises(BackendUnavailable, match="closed"):
        index.submit_lookup([[KEY]])
    client.close()
    with pytest.raises(BackendUnavailable, match="closed"):
        second.exists([KEY])
