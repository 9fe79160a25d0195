"""The ``ManagedTier``, ``SupportsBlockTransfer`` and ``SupportsHeldLookups`` conformance suites against a
real LMCache server; the block transfer one moving a CPU engine's blocks through ``kvcore_cpu``'s
``MappedMovers``.

Not declared, so skipped with the capability's name: failure injection and stalls (a real server
offers neither hook) and a capacity (the server's smallest L1 is far larger than the suite's values).
"""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch

from kvcore.ids import ChunkKey
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.testing.blocks import BlockTransferTests
from kvcore.testing.index import HeldLookupTests
from kvcore.testing.managed import ManagedTierTests
from kvcore.testing.support import SETTLE_S
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.tier import MappedMovers
from kvcore_lmcache import LMCacheChunkIndex, LMCacheManagedTier
from kvcore_lmcache.config import LMCacheMPConfig
from tests.frozen import frozen
from tests.lmcache.conftest import LMCacheServer
from tests.lmcache.raw import RawClient

HOST_SIZE = 16 * 1024
VALUE_BYTES = 4096
# a CPU engine of one layer: 512-byte blocks, 8 to a value, room for the 4 values the suite needs
LAYOUT = KVLayout(
    LayoutKind.VLLM_CPU, num_blocks=32, block_tokens=16, num_kv_heads=1, head_size=8, dtype_size=2
)


class RawAccess:
    """A tier's values out of band (``RawClient``), and the tier's and the client's close."""

    backend: LMCacheManagedTier
    raw: RawClient

    def peek(self, key: ChunkKey, preceding: Sequence[ChunkKey] = ()) -> bytes | None:
        return self.raw.peek(key, preceding)

    def poke(self, key: ChunkKey, value: bytes, preceding: Sequence[ChunkKey] = ()) -> None:
        self.raw.poke(key, value, preceding)

    def close(self) -> None:
        self.backend.close()
        self.raw.close()


def _config(server: LMCacheServer) -> tuple[LMCacheMPConfig, str]:
    """The tier's config, and a model id of its own, with the characters an engine's model id may carry
    and the server refuses ('@')."""
    config = LMCacheMPConfig(url=server.url, request_timeout_s=SETTLE_S / 2, heartbeat_s=1.0)
    return config, f"org/conformance-{uuid.uuid4().hex[:8]}@main"


class TierHarness(RawAccess):
    def __init__(self, server: LMCacheServer) -> None:
        config, model = _config(server)
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


class BlockTierHarness(RawAccess):
    """A tier with no host buffer, moving a CPU engine's blocks (one bf16 tensor) through a
    ``MappedMover`` over the server's pool; the engine's bytes are read and written out of band."""

    def __init__(self, server: LMCacheServer) -> None:
        config, model = _config(server)
        tensor = torch.zeros(LAYOUT.shape, dtype=torch.bfloat16)
        kv = EngineKV.register([tensor], LAYOUT)
        self._memory = tensor.reshape(-1).view(torch.uint8).numpy()
        self.num_engine_blocks = LAYOUT.num_blocks
        self.block_bytes = kv.host_block_bytes
        self.blocks_per_chunk = VALUE_BYTES // self.block_bytes
        self.backend = LMCacheManagedTier(
            config,
            None,
            value_bytes=VALUE_BYTES,
            chunk_tokens=server.chunk_tokens,
            model_name=model,
            block_movers=MappedMovers(kv),
            block_bytes=self.block_bytes,
        )
        self.raw = RawClient(server.url, model, VALUE_BYTES, server.chunk_tokens, align=self.block_bytes)

    def read_engine_block(self, block: int) -> bytes:
        return b"".join(self._memory[s.offset : s.stop].tobytes() for s in LAYOUT.segments(block))

    def write_engine_block(self, block: int, data: bytes) -> None:
        source = np.frombuffer(data, dtype=np.uint8)
        at = 0
        for segment in LAYOUT.segments(block):
            self._memory[segment.offset : segment.stop] = source[at : at + segment.length]
            at += segment.length


class TestLMCacheManagedTier(ManagedTierTests[LMCacheManagedTier]):
    @pytest.fixture
    def harness(self, lmcache_server: LMCacheServer) -> Iterator[TierHarness]:
        with contextlib.closing(TierHarness(lmcache_server)) as harness:
            yield harness


class TestLMCacheBlockTransfer(BlockTransferTests[LMCacheManagedTier]):
    @pytest.fixture
    def harness(self, lmcache_server: LMCacheServer) -> Iterator[BlockTierHarness]:
        with contextlib.closing(BlockTierHarness(lmcache_server)) as harness:
            yield harness


def stopped(server: LMCacheServer) -> contextlib.AbstractContextManager[None]:
    """The server frozen while inside (``tests.frozen``), thawed on exit holding what it held."""
    assert server.pid is not None
    return frozen(server.pid)


class IndexHarness:
    """The scheduler's index; ``make_present`` stores the keys as one chain through ``RawClient``."""

    def __init__(self, server: LMCacheServer) -> None:
        config, model = _config(server)
        self.outage = functools.partial(stopped, server)
        self.backend = LMCacheChunkIndex(
            config, value_bytes=VALUE_BYTES, chunk_tokens=server.chunk_tokens, model_name=model
        )
        self.raw = RawClient(server.url, model, VALUE_BYTES, server.chunk_tokens)

    def make_present(self, keys: Sequence[ChunkKey]) -> None:
        for i, key in enumerate(keys):
            self.raw.poke(key, bytes(VALUE_BYTES), keys[:i])

    def make_absent(self, keys: Sequence[ChunkKey]) -> None:
        raise AssertionError("an LMCache server removes no single key; the held-lookup suite needs none")

    def close(self) -> None:
        self.backend.close()
        self.raw.close()


class TestLMCacheHeldLookups(HeldLookupTests[LMCacheChunkIndex]):
    @pytest.fixture
    def harness(self, lmcache_server: LMCacheServer) -> Iterator[IndexHarness]:
        with contextlib.closing(IndexHarness(lmcache_server)) as harness:
            yield harness
