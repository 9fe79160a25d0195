"""Checked by mypy, never run: each in-tree backend satisfies the ports it claims."""

from __future__ import annotations

from kvcore.block_pool import BlockPool
from kvcore.pool_index import PoolIndex
from kvcore.ports import (
    BlockMover,
    ChunkIndex,
    ChunkStore,
    ManagedTier,
    PeerTransport,
    SupportsClear,
    SupportsImmediateLookup,
)
from kvcore_cpu.mover import TorchBlockMover
from kvcore_lmcache import LMCacheChunkIndex, LMCacheManagedTier
from kvcore_mooncake.index import MooncakeChunkIndex
from kvcore_mooncake.pd import MooncakePeerTransport
from kvcore_mooncake.store import MooncakeChunkStore


def cpu_mover(mover: TorchBlockMover) -> BlockMover:
    return mover


def pool_index(pool: BlockPool) -> tuple[ChunkIndex, SupportsImmediateLookup]:
    index = PoolIndex(pool)
    return index, index


def mooncake_store(store: MooncakeChunkStore) -> tuple[ChunkStore, SupportsClear]:
    return store, store


def mooncake_index(index: MooncakeChunkIndex) -> ChunkIndex:
    return index


def mooncake_peer(transport: MooncakePeerTransport) -> PeerTransport:
    return transport


def lmcache_tier(tier: LMCacheManagedTier) -> ManagedTier:
    return tier


def lmcache_index(index: LMCacheChunkIndex) -> ChunkIndex:
    return index
