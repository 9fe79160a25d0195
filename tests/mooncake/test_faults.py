"""Faults against a real master: down at start-up, killed mid-run, restarted, a value larger than the
segment, a full segment. Each ends in its expected outcome within a stated bound, never in a hang."""

from __future__ import annotations

import contextlib
import ctypes
import re
import time
from collections.abc import Iterator

import pytest

from kvcore.errors import BackendUnavailable
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobResult
from kvcore.kit.health import CircuitBreaker
from kvcore.ports import StoreItem
from kvcore.scheduling.remote_lookup import PendingLookup, PrefixLookup
from kvcore.testing.support import fresh_keys, payload
from kvcore_mooncake import MooncakeChunkIndex, MooncakeChunkStore, MooncakeClient
from tests.mooncake.conftest import MasterFactory, MiB, config_for, free_port

RPC_TIMEOUT_S = 4.5
"""How long Mooncake 0.3.13 holds a call to a dead master before it answers -900."""


class Buffer:
    def __init__(self, length: int) -> None:
        self._memory = ctypes.create_string_buffer(length)
        self.address = ctypes.addressof(self._memory)
        self.length = length

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.address + offset, data, len(data))

    def read(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.address + offset, length)


@contextlib.contextmanager
def closing_all(*things: MooncakeChunkStore | MooncakeChunkIndex | MooncakeClient) -> Iterator[None]:
    try:
        yield
    finally:
        for thing in things:
            thing.close()


def wait_result(store: MooncakeChunkStore, job: JobId, bound: float) -> JobResult:
    start = time.monotonic()
    (result,) = store.wait([job], bound)
    assert time.monotonic() - start < bound
    return result


def settle(lookup: PrefixLookup, chunks: list[list[ChunkKey]], bound: float) -> int:
    """Drive the core's lookup to an answer as the scheduler does, step after step; fail past ``bound``."""
    deadline = time.monotonic() + bound
    pending = lookup.begin(chunks)
    while isinstance(pending, PendingLookup):
        assert time.monotonic() < deadline, "a lookup did not settle in time"
        time.sleep(0.01)
        answer = lookup.resume(pending)
        if answer is not None:
            return answer
    return pending


def test_master_down_at_start_up_fails_fast_naming_it() -> None:
    # nobody listens on the port -> BackendUnavailable at once, naming the address
    address = f"127.0.0.1:{free_port()}"
    config = config_for(address)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable, match=re.escape(address)):
        MooncakeClient.connect(config)
    with pytest.raises(BackendUnavailable, match="not reachable"):
        MooncakeChunkIndex.open(config, timeout_s=1.0)
    assert time.monotonic() - start < 1.0


def test_killed_then_restarted_master(master_factory: MasterFactory) -> None:
    master = master_factory()
    buffer = Buffer(1 * MiB)
    holder = MooncakeClient.connect(config_for(master.address, 32 * MiB))
    store = MooncakeChunkStore(
        MooncakeClient.connect(config_for(master.address)),
        buffer.address,
        buffer.length,
        owns_client=True,
        breaker=CircuitBreaker(threshold=1, backoff_s=1.0),
    )
    index = MooncakeChunkIndex.open(config_for(master.address), timeout_s=0.5)
    with closing_all(store, index, holder):
        before, during, after = fresh_keys(3)
        buffer.write(0, payload(4096, before))
        item = StoreItem(before, 0, 4096)
        assert wait_result(store, store.submit_put([item]), 2.0).ok
        lookup = PrefixLookup(index, timeout_s=1.0, breaker=CircuitBreaker(threshold=3, backoff_s=0.5))
        assert settle(lookup, [[before]], 2.0) == 1

        # killed: lookups are misses within the lookup timeout, gets and puts fail, nothing hangs
        master.kill()
        start = time.monotonic()
        assert settle(lookup, [[before]], 2.0) == 0
        assert wait_result(store, store.submit_get([item]), RPC_TIMEOUT_S + 2).failed == (0,)
        # one failure opened the store's breaker: puts are dropped and exists refuses, at once
        put = StoreItem(during, 4096, 4096)
        assert wait_result(store, store.submit_put([put]), 0.5).failed == (0,)
        with pytest.raises(BackendUnavailable):
            store.exists([before])
        assert time.monotonic() - start < RPC_TIMEOUT_S + 3

        # restarted on the same port: the same objects rejoin it once the breakers probe again; the
        # restarted master lost every key, new puts work
        master.start()
        deadline = time.monotonic() + 15
        while True:
            buffer.write(8192, payload(4096, after))
            result = wait_result(store, store.submit_put([StoreItem(after, 8192, 4096)]), RPC_TIMEOUT_S + 2)
            if result.ok:
                break
            assert time.monotonic() < deadline, f"no rejoin: {result.error}"
            time.sleep(0.5)
        assert store.exists([before, after]) == (False, True)
        assert wait_result(store, store.submit_get([StoreItem(after, 0, 4096)]), 2.0).ok
        assert buffer.read(0, 4096) == payload(4096, after)
        deadline = time.monotonic() + 10
        while settle(lookup, [[after]], 3.0) != 1:
            assert time.monotonic() < deadline, "the index never rejoined the restarted master"
            time.sleep(0.3)
        lookup.close()


def test_value_larger_than_the_segment_fails_cleanly(master_factory: MasterFactory) -> None:
    master = master_factory()
    buffer = Buffer(24 * MiB)
    holder = MooncakeClient.connect(config_for(master.address, 16 * MiB))
    store = MooncakeChunkStore.open(config_for(master.address), buffer.address, buffer.length)
    with closing_all(store, holder):
        big, small = fresh_keys(2)
        result = wait_result(
            store, store.submit_put([StoreItem(big, 0, 20 * MiB), StoreItem(small, 0, 64)]), 5
        )
        assert result.failed == (0,)
        assert result.error is not None
        assert "no space" in result.error
        assert store.exists([big, small]) == (False, True)


def test_full_segment_is_evicted_by_the_master(master_factory: MasterFactory) -> None:
    # 16 MiB segment, 40 values of 1 MiB put one by one -> the master evicts; puts keep succeeding,
    # never more than the segment is held, and what is held reads back intact
    master = master_factory("--eviction_high_watermark_ratio=0.8", "--eviction_ratio=0.2")
    buffer = Buffer(2 * MiB)
    holder = MooncakeClient.connect(config_for(master.address, 16 * MiB))
    store = MooncakeChunkStore.open(config_for(master.address), buffer.address, buffer.length)
    with closing_all(store, holder):
        keys = fresh_keys(40)
        start = time.monotonic()
        results = []
        for key in keys:
            buffer.write(0, payload(MiB, key))
            results.append(wait_result(store, store.submit_put([StoreItem(key, 0, MiB)]), 5))
            if not results[-1].ok:
                time.sleep(0.05)  # eviction runs in the background: a full pool is a dropped save
        assert time.monotonic() - start < 20
        assert all(r.ok or "no space" in (r.error or "") for r in results)
        assert sum(r.ok for r in results[20:]) >= 15, "puts kept failing once the segment was full"
        held = [k for k, present in zip(keys, store.exists(keys), strict=True) if present]
        assert 0 < len(held) <= 16
        for key in held[-3:]:
            result = wait_result(store, store.submit_get([StoreItem(key, MiB, MiB)]), 5)
            assert not result.ok or buffer.read(MiB, MiB) == payload(MiB, key)
