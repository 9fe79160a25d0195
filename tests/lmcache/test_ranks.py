"""Two ranks of one engine on one LMCache server: same model, same request ids, lookups and jobs in
lockstep, different shard keys. Their server sessions must never mix (the server keys its lookup state
and its cached chunk hashes by session)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from functools import partial

import pytest

from kvcore.ids import ChunkKey, RequestId
from kvcore.ports import StoreItem
from kvcore.testing.support import SETTLE_S, payload, settle, wait_one
from kvcore_lmcache import LMCacheChunkIndex, LMCacheManagedTier
from kvcore_lmcache.config import LMCacheMPConfig
from tests.lmcache.conftest import LMCacheServer

VALUE_BYTES = 4096
CHUNKS = 4


class Rank:
    """One rank's tier over its own host buffer."""

    def __init__(self, server: LMCacheServer, model: str) -> None:
        config = LMCacheMPConfig(url=server.url, request_timeout_s=SETTLE_S / 2, heartbeat_s=1.0)
        self.host = bytearray(CHUNKS * VALUE_BYTES)
        self.tier = LMCacheManagedTier(
            config, self.host, value_bytes=VALUE_BYTES, chunk_tokens=server.chunk_tokens, model_name=model
        )


@pytest.fixture
def model() -> str:
    return f"org/ranks-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def ranks(lmcache_server: LMCacheServer, model: str) -> Iterator[list[Rank]]:
    pair = [Rank(lmcache_server, model) for _ in range(2)]
    yield pair
    for rank in pair:
        rank.tier.close()


def _items(keys: list[ChunkKey]) -> list[StoreItem]:
    return [StoreItem(key, i * VALUE_BYTES, VALUE_BYTES) for i, key in enumerate(keys)]


def test_ranks_with_one_request_id_keep_their_shards_apart(
    ranks: list[Rank], lmcache_server: LMCacheServer, model: str
) -> None:
    run = uuid.uuid4().hex[:8]
    chains = [[ChunkKey(f"kv/{run}/rank{r}/{i}") for i in range(CHUNKS)] for r in range(2)]
    values = [b"".join(payload(VALUE_BYTES, key) for key in chain) for chain in chains]
    for rank, value in zip(ranks, values, strict=True):
        rank.host[:] = value
    request = RequestId("req-1")  # every rank of an engine names a request alike
    stores = [
        rank.tier.submit_store(request, _items(chain)) for rank, chain in zip(ranks, chains, strict=True)
    ]
    for rank, job in zip(ranks, stores, strict=True):
        assert wait_one(rank.tier, job).ok
    lookups = [rank.tier.submit_lookup(request, chain) for rank, chain in zip(ranks, chains, strict=True)]
    for rank, lookup in zip(ranks, lookups, strict=True):
        assert settle(partial(rank.tier.poll_lookup, lookup), "a rank's lookup") == CHUNKS
    for rank in ranks:
        rank.host[:] = bytes(len(rank.host))
    loads = [
        rank.tier.submit_retrieve(request, _items(chain)) for rank, chain in zip(ranks, chains, strict=True)
    ]
    for rank, job, value in zip(ranks, loads, values, strict=True):
        assert wait_one(rank.tier, job).ok
        assert rank.host == value
        rank.tier.end_session(request)
    # the scheduler's view: each rank's shard is one chain of a two-shard lookup
    index = LMCacheChunkIndex(
        LMCacheMPConfig(url=lmcache_server.url, request_timeout_s=SETTLE_S / 2),
        value_bytes=VALUE_BYTES,
        chunk_tokens=lmcache_server.chunk_tokens,
        model_name=model,
    )
    with contextlib.closing(index):
        both = [[chains[0][i], chains[1][i]] for i in range(CHUNKS)]
        lookup = index.submit_lookup(both[2:], both[:2])
        assert settle(partial(index.poll_lookup, lookup), "the index lookup") == CHUNKS - 2
