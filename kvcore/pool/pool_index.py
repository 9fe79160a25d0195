"""The CPU tier's block pool seen through the ``ChunkIndex`` and ``SupportsImmediateLookup`` ports.

The pool holds one key per chunk of one shard; the ports ask about chunks given by the keys of all their
shards. A chunk counts only when every one of its keys is ready in the pool. Lookups are pure reads: they
never touch (recency) or pin; the scheduler does that for the chunks it decides to load.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.ids import ChunkKey
from kvcore.kit.immediate_index import ImmediateIndex
from kvcore.kit.leading import leading_chunks
from kvcore.pool.block_pool import BlockPool

__all__ = ["PoolIndex"]


class PoolIndex(ImmediateIndex):
    """Answers lookups from a ``BlockPool`` at once; a submitted lookup is answered when it is polled
    (``ImmediateIndex``).

    Like the pool, it belongs to the scheduler's thread. Lookups from several threads are safe with one
    another (each step is a single dict operation), not with changes to the pool.
    """

    def __init__(self, pool: BlockPool) -> None:
        super().__init__("the pool index")
        self._pool = pool

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        """How many leading chunks have every shard key ready in the pool. Changes nothing."""
        ready = self._pool.lookup
        return leading_chunks(chunks, lambda shards: ready(shards) == len(shards))
