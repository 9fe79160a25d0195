"""The CPU tier's block pool seen through the ``ChunkIndex`` and ``SupportsImmediateLookup`` ports.

The pool holds one key per chunk of one shard; the ports ask about chunks given by the keys of all their
shards. A chunk counts only when every one of its keys is ready in the pool. Lookups are pure reads: they
never touch (recency) or pin; the scheduler does that for the chunks it decides to load.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvcore.block_pool import BlockPool
from kvcore.errors import BackendUnavailable, UsageError
from kvcore.ids import ChunkKey, LookupId

__all__ = ["PoolIndex"]


class PoolIndex:
    """Answers lookups from a ``BlockPool`` at once; a submitted lookup is answered when it is polled.

    Like the pool, it belongs to the scheduler's thread. Lookups from several threads are safe with one
    another (each step is a single dict operation), not with changes to the pool.
    """

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._lookups: dict[LookupId, tuple[tuple[ChunkKey, ...], ...]] = {}
        self._ids = itertools.count(1)
        self._closed = False

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        """How many leading chunks have every shard key ready in the pool. Changes nothing."""
        ready = self._pool.lookup
        count = 0
        for chunk in chunks:
            if ready(chunk) != len(chunk):
                break
            count += 1
        return count

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """Record ``chunks``; ``poll_lookup`` answers from the pool as it is then. Raises only after
        ``close`` (``BackendUnavailable``).

        The pool keys each chunk alone, so ``preceding`` is ignored."""
        self._check_open()
        lookup_id = LookupId(next(self._ids))
        self._lookups[lookup_id] = tuple(tuple(chunk) for chunk in chunks)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int:
        """The answer, once (never pending). Raises ``UsageError`` for an id that is unknown, cancelled or
        already answered, ``BackendUnavailable`` after ``close``."""
        self._check_open()
        chunks = self._lookups.pop(lookup_id, None)
        if chunks is None:
            raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
        return self.lookup(chunks)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        """Forget a lookup. Unknown, answered or cancelled ids are ignored."""
        self._lookups.pop(lookup_id, None)

    def close(self) -> None:
        """Answer no more lookups (``ChunkIndex.close``); the pool is the scheduler's and stays.
        Idempotent."""
        self._closed = True
        self._lookups.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the pool index is closed: it answers no lookup")
