"""Checked by mypy, never run: each in-tree backend satisfies the ports it claims."""

from __future__ import annotations

from kvcore.execution.remote import ManagedRemote, StoreRemote
from kvcore.pool.block_pool import BlockPool
from kvcore.pool.pool_index import PoolIndex
from kvcore.ports import (
    BlockMover,
    ChunkIndex,
    ChunkStore,
    ManagedTier,
    OrderedMover,
    PeerTransport,
    RemoteTier,
    SupportsBlockTransfer,
    SupportsClear,
    SupportsImmediateLookup,
)
from kvcore_cpu.checksums import ChecksummedMover
from kvcore_cpu.mover import TorchBlockMover
from kvcore_disk import DiskChunkIndex, DiskChunkStore
from kvcore_lmcache import LMCacheChunkIndex, LMCacheManagedTier
from kvcore_mooncake.index import MooncakeChunkIndex
from kvcore_mooncake.pd import MooncakePeerTransport
from kvcore_mooncake.store import MooncakeChunkStore


def cpu_mover(mover: TorchBlockMover, checked: ChecksummedMover) -> tuple[OrderedMover, BlockMover]:
    return mover, checked


def pool_index(pool: BlockPool) -> tuple[ChunkIndex, SupportsImmediateLookup]:
    index = PoolIndex(pool)
    return index, index


def mooncake_store(store: MooncakeChunkStore) -> tuple[ChunkStore, SupportsClear]:
    return store, store


def mooncake_index(index: MooncakeChunkIndex) -> ChunkIndex:
    return index


def mooncake_peer(transport: MooncakePeerTransport) -> PeerTransport:
    return transport


def lmcache_tier(tier: LMCacheManagedTier) -> tuple[ManagedTier, SupportsBlockTransfer]:
    return tier, tier


def remotes(store: StoreRemote, managed: ManagedRemote) -> tuple[RemoteTier, RemoteTier]:
    return store, managed


def lmcache_index(index: LMCacheChunkIndex) -> ChunkIndex:
    return index


def disk_store(store: DiskChunkStore) -> tuple[ChunkStore, SupportsClear]:
    return store, store


def disk_index(index: DiskChunkIndex) -> tuple[ChunkIndex, SupportsImmediateLookup]:
    return index, index
