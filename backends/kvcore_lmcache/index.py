"""``LMCacheChunkIndex``: the scheduler's view of an LMCache server, as kvcore's ``ChunkIndex`` port.

It runs in the scheduler process (vLLM's engine core), apart from the workers, and only asks which
leading chunks the server holds: every lookup's read locks are released as soon as it is answered, so
the index never pins anything (the worker's ``LMCacheManagedTier`` locks what it is about to load).
A lookup never blocks: submit, then poll; an absent server raises ``BackendUnavailable`` at once and a
silent one ``TransferTimeout`` at the request timeout, which ``kvcore.lookup.PrefixLookup`` turns into
a miss and its circuit breaker.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from kvcore.errors import BackendUnavailable, UsageError
from kvcore.ids import ChunkKey, LookupId, RequestId
from kvcore_lmcache.config import LMCacheMPConfig
from kvcore_lmcache.link import ServerLink, SlotLayout
from kvcore_lmcache.lookups import LookupBook

__all__ = ["LMCacheChunkIndex"]


class LMCacheChunkIndex:
    """Which leading chunks (every shard's key present) an LMCache server holds.

    ``value_bytes`` and ``block_bytes`` must be the workers' (their slot size is part of the server-side
    model name their layout is registered under); the index itself registers nothing.
    """

    def __init__(
        self,
        config: LMCacheMPConfig,
        *,
        value_bytes: int,
        chunk_tokens: int,
        model_name: str,
        block_bytes: int = 1,
    ) -> None:
        self.link = ServerLink(
            config,
            chunk_tokens,
            model_name,
            SlotLayout(value_bytes, block_bytes),
            register=False,
        )
        self._lookups = LookupBook(self.link)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._asked: dict[LookupId, int] = {}  # chunks asked (after the preceding ones)
        self._closed = False

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """One server lookup per shard: the shard's keys of ``preceding`` and ``chunks`` as one chain.
        Raises ``BackendUnavailable`` while the server is down, and after ``close``."""
        self._check_open()
        shards = {len(chunk) for chunk in (*preceding, *chunks)}
        if len(shards) > 1 or 0 in shards:
            raise UsageError(f"every chunk needs the same, non-zero number of shard keys, got {shards}")
        width = shards.pop() if shards else 1
        whole = (*preceding, *chunks)
        chains = [[chunk[shard] for chunk in whole] for shard in range(width)]
        session = RequestId(f"index-{next(self._ids)}")
        lookup_id = self._lookups.submit(session, chains, len(preceding))
        with self._lock:
            self._asked[lookup_id] = len(chunks)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        self._check_open()
        with self._lock:
            asked = self._asked.get(lookup_id)
        if asked is None:
            raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
        try:
            answer = self._lookups.poll(lookup_id)
        except BaseException:
            with self._lock:
                self._asked.pop(lookup_id, None)
            raise
        if answer is None:
            return None
        with self._lock:
            self._asked.pop(lookup_id, None)
        state, hits = answer
        for server, chain in zip(state.servers, state.chains, strict=True):
            self.link.release(server, chain, ((0, len(chain)),))
        return min(max(min(hits) - state.first, 0), asked)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        with self._lock:
            self._asked.pop(lookup_id, None)
        self._lookups.cancel(lookup_id)

    def close(self) -> None:
        """Drop the pending lookups and the connection; later lookups raise ``BackendUnavailable``.
        Idempotent."""
        with self._lock:
            self._closed = True
            self._asked.clear()
        self.link.close()

    def _check_open(self) -> None:
        with self._lock:
            if self._closed:
                raise BackendUnavailable("the LMCache index is closed")
