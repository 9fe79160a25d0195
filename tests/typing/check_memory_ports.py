"""Checked by mypy, never run: each in-memory reference backend satisfies its port and its test hooks."""

from __future__ import annotations

from kvcore.ports import (
    BlockMover,
    ChunkIndex,
    ChunkStore,
    ManagedTier,
    OrderedMover,
    PeerTransport,
    SupportsBlockTransfer,
    SupportsClear,
    SupportsImmediateLookup,
)
from kvcore.testing.capabilities import SupportsFailureInjection, SupportsPinning, SupportsStall
from kvcore.testing.memory import (
    InMemoryAddressSpace,
    InMemoryBlockMover,
    InMemoryBlockTransferTier,
    InMemoryChunkIndex,
    InMemoryChunkStore,
    InMemoryManagedTier,
    InMemoryPeerTransport,
)


def ports(host: bytearray, space: InMemoryAddressSpace) -> None:
    index: ChunkIndex = InMemoryChunkIndex()
    immediate: SupportsImmediateLookup = InMemoryChunkIndex()
    mover: BlockMover = InMemoryBlockMover(num_engine_blocks=1, num_host_blocks=1, layer_block_bytes=1)
    ordered: OrderedMover = InMemoryBlockMover(num_engine_blocks=1, num_host_blocks=1, layer_block_bytes=1)
    store: ChunkStore = InMemoryChunkStore(host)
    managed: ManagedTier = InMemoryManagedTier(host)
    blocks: SupportsBlockTransfer = InMemoryBlockTransferTier(
        host,
        engine=InMemoryBlockMover(num_engine_blocks=1, num_host_blocks=1, layer_block_bytes=1),
        blocks_per_chunk=1,
    )
    peer: PeerTransport = InMemoryPeerTransport(space, "peer")
    clearable: list[SupportsClear] = [InMemoryChunkIndex(), InMemoryChunkStore(host)]
    del index, immediate, mover, ordered, store, managed, blocks, peer, clearable


def hooks(host: bytearray, space: InMemoryAddressSpace) -> None:
    failing: list[SupportsFailureInjection] = [
        InMemoryChunkIndex(),
        InMemoryBlockMover(num_engine_blocks=1, num_host_blocks=1, layer_block_bytes=1),
        InMemoryChunkStore(host),
        InMemoryManagedTier(host),
        InMemoryPeerTransport(space, "peer"),
    ]
    stalling: list[SupportsStall] = [InMemoryChunkIndex(), InMemoryChunkStore(host)]
    pinning: SupportsPinning = InMemoryChunkIndex()
    del failing, stalling, pinning
