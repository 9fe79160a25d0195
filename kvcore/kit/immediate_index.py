"""``ImmediateIndex``: the ``ChunkIndex`` port of an index that answers at once
(``SupportsImmediateLookup``: the CPU pool, a local disk), so that each such index writes only its
``lookup``.

A submitted lookup records its chunks and is answered from ``lookup`` when it is polled (never pending);
``preceding`` is ignored (these indexes key each chunk alone). An id that is unknown, cancelled or already
answered is refused with ``UsageError``; after ``close`` every call but ``cancel_lookup`` raises
``BackendUnavailable``.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvcore.errors import BackendUnavailable, UsageError
from kvcore.ids import ChunkKey, LookupId

__all__ = ["ImmediateIndex"]


class ImmediateIndex(ABC):
    """``submit_lookup``/``poll_lookup``/``cancel_lookup``/``close`` over a subclass's ``lookup``;
    ``name`` names the index in errors."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lookups: dict[LookupId, tuple[tuple[ChunkKey, ...], ...]] = {}
        self._ids = itertools.count(1)
        self._closed = False

    @abstractmethod
    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        """How many leading chunks the tier holds, every shard key of each. Changes nothing."""

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """Record ``chunks``; ``poll_lookup`` answers from the tier as it is then."""
        self._check_open()
        lookup_id = LookupId(next(self._ids))
        self._lookups[lookup_id] = tuple(tuple(chunk) for chunk in chunks)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int:
        """The answer, once (never pending)."""
        self._check_open()
        chunks = self._lookups.pop(lookup_id, None)
        if chunks is None:
            raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
        return self.lookup(chunks)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        """Forget a lookup. Unknown, answered or cancelled ids are ignored."""
        self._lookups.pop(lookup_id, None)

    def close(self) -> None:
        """Answer no more lookups (``ChunkIndex.close``); what the index reads stays. Idempotent."""
        self._closed = True
        self._lookups.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable(f"{self._name} is closed: it answers no lookup")
