"""Faults of a real LMCache server and what the backend does about each, with a time bound.

Server absent at start, killed mid-run, restarted, frozen (silence), a different chunk size, an address
nothing listens on: lookups miss (quickly), nothing hangs, and the backend rejoins by itself. Tests that
kill or freeze a server get their own; the others share the session server.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvcore.errors import BackendError, BackendUnavailable, ConfigError
from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.ports import BlockItem, StoreItem
from kvcore.scheduling.remote_lookup import PendingLookup, PrefixLookup
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.tier import MappedMovers
from kvcore_lmcache import LMCacheChunkIndex, LMCacheManagedTier
from kvcore_lmcache.config import LMCacheMPConfig
from tests.lmcache.conftest import CHUNK_TOKENS, LMCacheServer

VALUE = 1024
SLOTS = 8
TIMEOUT_S = 0.5
CONNECT_S = 0.5
BEAT_S = 0.2
REJOIN_S = 5.0

Factory = Callable[[int], LMCacheServer]


def _config(url: str) -> LMCacheMPConfig:
    return LMCacheMPConfig(
        url=url, request_timeout_s=TIMEOUT_S, heartbeat_s=BEAT_S, connect_timeout_s=CONNECT_S
    )


class HostSide:
    """Values through the worker's host buffer (the ``ManagedTier`` calls)."""

    def __init__(self, tier_args: dict[str, Any]) -> None:
        self.host = bytearray(SLOTS * VALUE)
        self.tier = LMCacheManagedTier(host=self.host, value_bytes=VALUE, **tier_args)

    def store(self, keys: list[ChunkKey]) -> bool:
        for i, key in enumerate(keys):
            self.host[i * VALUE : (i + 1) * VALUE] = key.encode().ljust(VALUE, b".")
        items = [StoreItem(key, i * VALUE, VALUE) for i, key in enumerate(keys)]
        return _ok(self.tier, lambda: self.tier.submit_store(RequestId("store"), items))

    def retrieved(self, keys: list[ChunkKey]) -> bool:
        """Whether every key's value comes back byte for byte (into a zeroed host buffer)."""
        self.host[:] = bytes(len(self.host))
        session = RequestId(f"r-{uuid.uuid4().hex[:8]}")
        items = [StoreItem(key, i * VALUE, VALUE) for i, key in enumerate(keys)]
        try:
            ok = _ok(self.tier, lambda: self.tier.submit_retrieve(session, items))
        finally:
            self.tier.end_session(session)
        expected = [key.encode().ljust(VALUE, b".") for key in keys]
        return ok and [bytes(self.host[i * VALUE : (i + 1) * VALUE]) for i in range(len(keys))] == expected


class BlockSide:
    """Values moved straight between engine blocks (a CPU engine's) and the server's slots."""

    LAYOUT = KVLayout(
        LayoutKind.VLLM_CPU, num_blocks=4 * SLOTS, block_tokens=16, num_kv_heads=1, head_size=8, dtype_size=2
    )

    def __init__(self, tier_args: dict[str, Any]) -> None:
        self.kv = EngineKV.register([torch.zeros(self.LAYOUT.shape, dtype=torch.bfloat16)], self.LAYOUT)
        block = self.kv.host_block_bytes
        self.tier = LMCacheManagedTier(
            host=None, value_bytes=block, block_movers=MappedMovers(self.kv), block_bytes=block, **tier_args
        )

    def store(self, keys: list[ChunkKey]) -> bool:
        (plane,) = self.kv.planes
        for i, key in enumerate(keys):
            plane[i].view(torch.uint8).fill_(1 + sum(key.encode()) % 250)
        items = [BlockItem(key, [i]) for i, key in enumerate(keys)]
        return _ok(self.tier, lambda: self.tier.submit_store_blocks(RequestId("store"), items))

    def retrieved(self, keys: list[ChunkKey]) -> bool:
        """Whether every key's value comes back byte for byte (into zeroed engine blocks)."""
        (plane,) = self.kv.planes
        plane[SLOTS : 2 * SLOTS].zero_()
        session = RequestId(f"r-{uuid.uuid4().hex[:8]}")
        items = [BlockItem(key, [SLOTS + i]) for i, key in enumerate(keys)]
        try:
            ok = _ok(self.tier, lambda: self.tier.submit_retrieve_blocks(session, items))
        finally:
            self.tier.end_session(session)
        return ok and all(bool(torch.equal(plane[SLOTS + i], plane[i])) for i in range(len(keys)))


def _ok(tier: LMCacheManagedTier, submit: Callable[[], JobId]) -> bool:
    (result,) = tier.wait([submit()], 4 * TIMEOUT_S)
    return result.ok


@contextlib.contextmanager
def _side(url: str, model: str, kind: str = "host") -> Iterator[HostSide | BlockSide]:
    args: dict[str, Any] = {"config": _config(url), "chunk_tokens": CHUNK_TOKENS, "model_name": model}
    side = HostSide(args) if kind == "host" else BlockSide(args)
    try:
        yield side
    finally:
        side.tier.close()


def _lookup(tier: LMCacheManagedTier, keys: list[ChunkKey]) -> int:
    """Hits through the core's ``PrefixLookup``-style loop: bounded, failures are 0."""
    session = RequestId(f"s-{uuid.uuid4().hex[:8]}")
    try:
        lookup_id = tier.submit_lookup(session, keys)
        deadline = time.monotonic() + 4 * TIMEOUT_S
        while (hits := tier.poll_lookup(lookup_id)) is None:
            assert time.monotonic() < deadline, "a lookup outlived its timeout"
            time.sleep(0.002)
    except BackendError:
        return 0
    finally:
        tier.end_session(session)
    return hits


def _keys(n: int) -> list[ChunkKey]:
    run = uuid.uuid4().hex[:8]
    return [ChunkKey(f"faults/{run}/{i}") for i in range(n)]


def _eventually(check: Callable[[], bool], within: float) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < within, f"not within {within}s"
        time.sleep(0.05)
    return time.monotonic() - start


def _bounded(action: Callable[[], object], within: float) -> object:
    start = time.monotonic()
    result = action()
    assert time.monotonic() - start < within, f"took longer than {within}s"
    return result


@pytest.mark.parametrize("kind", ["host", "blocks"])
def test_server_absent_at_start_then_killed_then_restarted(server_factory: Factory, kind: str) -> None:
    server = server_factory(CHUNK_TOKENS)
    started = time.monotonic()
    with _side(server.url, f"lifecycle-{kind}", kind) as side:
        tier = side.tier
        # absent at start: no long timeout, misses and failed stores at once
        assert time.monotonic() - started < CONNECT_S + 1.0
        assert not tier.link.connected
        with pytest.raises(BackendUnavailable):
            tier.submit_lookup(RequestId("r"), _keys(1))
        first = _keys(2)
        assert not _bounded(lambda: side.store(first), 0.1)

        server.start()  # it appears: the heartbeat joins it
        _eventually(lambda: tier.link.connected, REJOIN_S)
        assert side.store(first)
        assert _lookup(tier, first) == 2
        assert side.retrieved(first)

        server.kill()  # mid-run: every call ends within its timeout, as a miss or a failed item
        assert _bounded(lambda: _lookup(tier, first), 4 * TIMEOUT_S) == 0
        assert not _bounded(lambda: side.store(_keys(1)), 4 * TIMEOUT_S)
        _eventually(lambda: not tier.link.available(), 4 * TIMEOUT_S)

        server.start()  # restarted: same URL, empty cache, a new shared-memory segment
        second = _keys(2)
        _eventually(lambda: side.store(second), REJOIN_S)
        assert _lookup(tier, second) == 2
        assert side.retrieved(second)  # through the re-mapped segment
        assert _lookup(tier, first) == 0  # the restart lost them; never garbage


@pytest.mark.parametrize("kind", ["host", "blocks"])
def test_a_closed_tier_refuses_new_jobs_at_once(lmcache_server: LMCacheServer, kind: str) -> None:
    # e.g. the vLLM worker halted it after a late load: later ops must fail now, not wait forever
    with _side(lmcache_server.url, f"closed-{kind}", kind) as side:
        keys = _keys(1)
        assert side.store(keys)
        side.tier.close()
        with pytest.raises(BackendError, match="closed"):
            side.store(keys)
        with pytest.raises(BackendError, match="closed"):
            side.retrieved(keys)


def test_silent_server_times_out_opens_the_breaker_and_rejoins(server_factory: Factory) -> None:
    server = server_factory(CHUNK_TOKENS)
    server.start()
    with _side(server.url, "silent") as side:
        tier, keys = side.tier, _keys(2)
        assert side.store(keys)
        server.pause()
        try:
            assert _bounded(lambda: _lookup(tier, keys), 4 * TIMEOUT_S) == 0
            _eventually(lambda: not tier.link.available(), 4 * TIMEOUT_S)
            assert _bounded(lambda: _lookup(tier, keys), 0.05) == 0  # breaker open: answered at once
        finally:
            server.resume()
        _eventually(lambda: _lookup(tier, keys) == 2, REJOIN_S)


def test_chunk_size_mismatch_is_a_config_error(lmcache_server: LMCacheServer) -> None:
    with pytest.raises(ConfigError, match=r"chunk_tokens.*server.s chunk size \(128\)"):
        LMCacheManagedTier(
            _config(lmcache_server.url), bytearray(VALUE), value_bytes=VALUE, chunk_tokens=32, model_name="m"
        )


def test_unreachable_url_is_a_miss_through_the_core_lookup() -> None:
    index = LMCacheChunkIndex(
        _config("tcp://127.0.0.1:9"), value_bytes=VALUE, chunk_tokens=CHUNK_TOKENS, model_name="m"
    )
    try:
        started = time.monotonic()
        answer = PrefixLookup(index, timeout_s=TIMEOUT_S).begin([[key] for key in _keys(3)])
        assert not isinstance(answer, PendingLookup)
        assert answer == 0
        assert time.monotonic() - started < 0.1
    finally:
        index.close()


def test_index_counts_leading_chunks_only(lmcache_server: LMCacheServer) -> None:
    model = f"index-{uuid.uuid4().hex[:8]}"
    with _side(lmcache_server.url, model) as side:
        keys = _keys(3)
        assert side.store([keys[0], keys[2]])
        index = LMCacheChunkIndex(
            _config(lmcache_server.url), value_bytes=VALUE, chunk_tokens=CHUNK_TOKENS, model_name=model
        )
        try:
            lookup = PrefixLookup(index, timeout_s=2.0)
            pending = lookup.begin([[key] for key in keys])
            assert isinstance(pending, PendingLookup)
            deadline = time.monotonic() + 2.0
            while (hits := lookup.resume(pending)) is None:
                assert time.monotonic() < deadline
                time.sleep(0.002)
            assert hits == 1
            lookup.close()
        finally:
            index.close()
