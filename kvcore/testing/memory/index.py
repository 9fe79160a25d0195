"""The in-memory reference ``ChunkIndex``es: a set of keys (``InMemoryChunkIndex``, also
``SupportsImmediateLookup``), and the index of a tier that answers from the tier itself
(``InMemoryStoreIndex``)."""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvcore.errors import (
    BackendError,
    UsageError,
)
from kvcore.ids import ChunkKey, LookupId
from kvcore.kit.leading import by_chunk, leading_chunks
from kvcore.testing.memory.common import Gate, Outages, check_answering, check_positive

__all__ = ["InMemoryChunkIndex", "InMemoryStoreIndex"]

Chunks = tuple[tuple[ChunkKey, ...], ...]


class _Lookups(Outages, Gate):
    """The submitted lookups of a reference index, answered from ``_count`` when polled; ``asked`` keeps
    each lookup's chunks and ``preceding``, for a test to see what an index was asked."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[Chunks, Chunks]] = []
        self._lookups: dict[LookupId, Chunks] = {}
        self._ids = itertools.count(1)
        self._closed = False

    def _count(self, chunks: Iterable[Sequence[ChunkKey]]) -> int:
        raise NotImplementedError

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """Record ``chunks``, answered when polled; keys stand alone here, so ``preceding`` is only
        recorded (``asked``)."""
        with self._cond:
            check_answering(self._closed, self)
            lookup_id = LookupId(next(self._ids))  # asked while the server is down: the poll says so
            self._lookups[lookup_id] = tuple(tuple(c) for c in chunks)
            self.asked.append((self._lookups[lookup_id], tuple(tuple(c) for c in preceding)))
            return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        """The answer, once; ``UsageError`` for an id that is unknown, cancelled or already answered."""
        with self._cond:
            check_answering(self._closed, self)
            if lookup_id not in self._lookups:
                raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
            if self._down:
                del self._lookups[lookup_id]
                self._check_reachable()
            if self._faults.stalled:
                return None
            chunks = self._lookups.pop(lookup_id)
            if self._take_failure():
                raise BackendError(f"lookup {lookup_id} failed (injected)")
            return self._count(chunks)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        with self._cond:
            self._lookups.pop(lookup_id, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._lookups.clear()


class InMemoryChunkIndex(_Lookups):
    """A set of keys answering ``ChunkIndex`` and ``SupportsImmediateLookup``.

    Optionally bounded to ``capacity`` keys: adding to a full index evicts the least recently added (or
    re-added) key that is not pinned; when every key is pinned the new key is refused. Submitted lookups
    are answered from the keys held when they are polled; polled during an ``outage``, a lookup fails
    (``BackendUnavailable``). Once closed, it answers none (``BackendUnavailable``); the immediate
    ``lookup`` still answers.
    """

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        check_positive("capacity", capacity, "a number of keys >= 1, or None for no bound")
        self.capacity = capacity
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()
        self._pins: Counter[ChunkKey] = Counter()

    def __len__(self) -> int:
        with self._cond:
            return len(self._keys)

    def __contains__(self, key: object) -> bool:
        with self._cond:
            return key in self._keys

    def add(self, keys: Iterable[ChunkKey]) -> tuple[bool, ...]:
        """Hold ``keys``, each becoming the most recent; says whether each is held afterwards."""
        with self._cond:
            return tuple(self._add(key) for key in keys)

    def _add(self, key: ChunkKey) -> bool:
        if key in self._keys:
            self._keys.move_to_end(key)
            return True
        if self.capacity is not None and len(self._keys) >= self.capacity:
            victim = next((k for k in self._keys if not self._pins[k]), None)
            if victim is None:
                return False
            del self._keys[victim]
        self._keys[key] = None
        return True

    def discard(self, keys: Iterable[ChunkKey]) -> None:
        """Drop ``keys``, pinned or not; absent keys are ignored."""
        with self._cond:
            for key in keys:
                self._keys.pop(key, None)

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        """Protect ``keys`` from eviction; pins count, so pin twice, unpin twice."""
        with self._cond:
            self._pins.update(keys)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Release one pin of each key; raises ``UsageError`` (changing nothing) for an unpinned key."""
        with self._cond:
            unpinned = [k for k, n in Counter(keys).items() if self._pins[k] < n]
            if unpinned:
                raise UsageError(f"unpin of keys not pinned: {unpinned}")
            self._pins.subtract(keys)
            self._pins = +self._pins

    def clear(self) -> None:
        """Drop every key (pins stay with their owners); pending lookups see the empty index."""
        with self._cond:
            self._keys.clear()

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        with self._cond:
            return self._count(chunks)

    def _count(self, chunks: Iterable[Sequence[ChunkKey]]) -> int:
        return leading_chunks(chunks, lambda shards: all(k in self._keys for k in shards))


class InMemoryStoreIndex(_Lookups):
    """The index of a tier that answers from the tier itself, as the Mooncake store's (``batch_is_exist``)
    and the disk tier's (a ``stat`` per file) do: a submitted lookup asks ``exists`` about every shard key
    of its chunks when it is polled, so it sees what the tier holds then. It has no immediate ``lookup``:
    the scheduler side sees it as a remote index. ``exists`` is a ``ChunkStore``'s, or any function
    answering one flag per key; what it raises reaches the poll.
    """

    def __init__(self, exists: Callable[[Sequence[ChunkKey]], Sequence[bool]]) -> None:
        super().__init__()
        self._exists = exists

    def _count(self, chunks: Iterable[Sequence[ChunkKey]]) -> int:
        shards = [tuple(chunk) for chunk in chunks]
        flags = self._exists([key for chunk in shards for key in chunk])
        return leading_chunks(by_chunk(flags, [len(chunk) for chunk in shards]), all)
