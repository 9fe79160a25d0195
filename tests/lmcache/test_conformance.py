"""The ``ManagedTier`` conformance suite against a real LMCache server.

Not declared, so skipped with the capability's name: failure injection and stalls (a real server
offers neither hook) and a capacity (the server's smallest L1 is far larger than the suite's values).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence

import pytest

from kvcore.ids import ChunkKey
from kvcore.testing.managed import ManagedTierTests
from kvcore.testing.support import SETTLE_S
from kvcore_lmcache import LMCacheManagedTier
from kvcore_lmcache.config import LMCacheMPConfig
from tests.lmcache.conftest import LMCacheServer
from tests.lmcache.raw import RawClient

HOST_SIZE = 16 * 1024
VALUE_BYTES = 4096


class TierHarness:
    def __init__(self, server: LMCacheServer) -> None:
        # an engine's model id as the vLLM adapter renders it ("name@revision"): the server refuses '@'
        model = f"org/conformance-{uuid.uuid4().hex[:8]}@main"
        config = LMCacheMPConfig(url=server.url, request_timeout_s=SETTLE_S / 2, heartbeat_s=1.0)
        self._host = bytearray(HOST_SIZE)
        self.host_size = HOST_SIZE
        self.backend = LMCacheManagedTier(
            config, self._host, value_bytes=VALUE_BYTES, chunk_tokens=server.chunk_tokens, model_name=model
        )
        self.raw = RawClient(server.url, model, VALUE_BYTES, server.chunk_tokens)

    def read_host(self, offset: int, length: int) -> bytes:
        return bytes(self._host[offset : offset + length])

    def write_host(self, offset: int, data: bytes) -> None:
        self._host[offset : offset + len(data)] = data

    def peek(self, key: ChunkKey, preceding: Sequence[ChunkKey] = ()) -> bytes | None:
        return self.raw.peek(key, preceding)

    def poke(self, key: ChunkKey, value: bytes, preceding: Sequence[ChunkKey] = ()) -> None:
        self.raw.poke(key, value, preceding)

    def close(self) -> None:
        self.backend.close()
        self.raw.close()


class TestLMCacheManagedTier(ManagedTierTests[LMCacheManagedTier]):
    @pytest.fixture
    def harness(self, lmcache_server: LMCacheServer) -> Iterator[TierHarness]:
        with contextlib.closing(TierHarness(lmcache_server)) as harness:
            yield harness
