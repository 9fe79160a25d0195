"""One op's blocks, put together chunk after chunk: which engine blocks, which host blocks of which slot,
which chunks also cross the remote tier, and how far into the request's chain the op reaches.

``CacheScheduler`` decides which chunks a load or a save covers; an ``OpDraft`` turns that into the
block lists and ``RemoteChunk``s of one ``BlockOp``, the same way for both directions.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.ids import ChunkKey
from kvcore.model.step import RemoteChunk

__all__ = ["OpDraft"]


class OpDraft:
    """The blocks of one op being built; chunks of ``blocks_per_chunk`` engine blocks each."""

    __slots__ = (
        "blocks_per_chunk",
        "chain_end",
        "engine_blocks",
        "fetched",
        "host_blocks",
        "keys",
        "remote",
        "sizes",
    )

    def __init__(self, blocks_per_chunk: int) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.engine_blocks: list[int] = []
        self.host_blocks: list[int] = []
        self.keys: list[ChunkKey] = []
        self.sizes: list[int] = []  # the op's blocks of each key
        self.remote: list[RemoteChunk] = []
        self.fetched: set[ChunkKey] = set()  # a load's chunks that come from the remote tier
        # how far into the request's chain the op reaches: one past its last chunk crossing the remote tier
        self.chain_end = 0

    def add(
        self,
        key: ChunkKey,
        chunk: int,
        block_ids: Sequence[int],
        slot: int | None,
        *,
        first_block: int = 0,
        num_blocks: int | None = None,
        shard_keys: tuple[ChunkKey | None, ...] | None = None,
        fetched: bool = False,
        value_blocks: int | None = None,
    ) -> None:
        """Add blocks ``first_block`` on of request chunk ``chunk`` (``num_blocks`` of them, default to
        the chunk's end), from the request's ``block_ids``, to host ``slot`` (``None``: no host slot).
        ``shard_keys``: the chunk also crosses the remote tier, under each rank's key; ``value_blocks``:
        it is a tail of that many blocks (``RemoteChunk.value_blocks``)."""
        per = self.blocks_per_chunk
        count = per - first_block if num_blocks is None else num_blocks
        if shard_keys is not None:
            first = len(self.engine_blocks)
            self.remote.append(RemoteChunk(slot, shard_keys, first, count, first_block, value_blocks))
            self.chain_end = chunk + 1
        if fetched:
            self.fetched.add(key)
        self.keys.append(key)
        self.sizes.append(count)
        first = chunk * per + first_block
        self.engine_blocks.extend(block_ids[first : first + count])
        if slot is not None:
            base = slot * per + first_block
            self.host_blocks.extend(range(base, base + count))
