"""The in-memory reference ``ManagedTier``, and ``SupportsBlockTransfer`` over an in-memory mover."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial

from kvcore.errors import (
    BackendUnavailable,
    InvalidSpecError,
    UsageError,
)
from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.jobs import JobResult
from kvcore.ports import BlockItem, StoreItem
from kvcore.testing.memory.common import (
    POISON,
    ValueJobs,
    Work,
    check_answering,
    check_items,
    check_positive,
    copy_out,
)
from kvcore.testing.memory.mover import InMemoryBlockMover

__all__ = ["InMemoryBlockTransferTier", "InMemoryManagedTier"]


class InMemoryManagedTier(ValueJobs):
    """A tier that owns its memory: values over one host ``bytearray``, sessions that lock lookup hits.

    A lookup locks its hits for the session; a retrieve releases the session's lock on what it read and
    ``end_session`` releases the rest. Storing into a full tier evicts the least recently used unlocked
    values; an item that finds no room fails. There is no remove. It keys chunks alone: a chain only
    fails the items whose keys it lacks, as the port requires. Once closed, it refuses every submit with
    ``BackendUnavailable`` and drops its pending lookups.
    """

    refused_after_close = BackendUnavailable

    def __init__(self, host: bytearray, capacity: int | None = None) -> None:
        super().__init__(host, capacity)
        self._locks: dict[RequestId, Counter[ChunkKey]] = {}
        self._lookups: dict[LookupId, int] = {}
        self._ids = itertools.count(1)

    @property
    def capacity(self) -> int | None:
        return self._values.capacity

    def _locked(self, key: ChunkKey) -> bool:
        return any(key in held for held in self._locks.values())

    def submit_lookup(
        self, session: RequestId, chunks: Sequence[ChunkKey], preceding: Sequence[ChunkKey] = ()
    ) -> LookupId:
        """Lock the session's leading hits; keys stand alone here, so ``preceding`` is ignored."""
        with self._cond:
            check_answering(self._closed, self)
            hits = list(itertools.takewhile(self._values.data.__contains__, chunks))
            self._locks.setdefault(session, Counter()).update(hits)
            for key in hits:
                self._values.data.move_to_end(key)
            lookup_id = LookupId(next(self._ids))
            self._lookups[lookup_id] = len(hits)
            return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        """The answer, once; ``UsageError`` for an id that is unknown or already answered."""
        with self._cond:
            check_answering(self._closed, self)
            if lookup_id not in self._lookups:
                raise UsageError(f"lookup {lookup_id} is unknown or already answered")
            if self._faults.stalled:
                return None
            return self._lookups.pop(lookup_id)

    def submit_store(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        check_items(items, len(self._host))
        items = tuple(items)
        keys = tuple(item.key for item in items)
        return self._submit(partial(self._store, keys, partial(self._read_host, items), _outside(chain)))

    def _read_host(self, items: tuple[StoreItem, ...], i: int) -> bytes:
        return bytes(self._host[items[i].offset : items[i].offset + items[i].length])

    def _store(
        self,
        keys: tuple[ChunkKey, ...],
        read: Callable[[int], bytes],
        outside: Callable[[ChunkKey], bool],
        job_id: JobId,
    ) -> JobResult:
        """Keep the value ``read(i)`` under each ``keys[i]`` (a present key keeps its value)."""
        failed: list[int] = []
        with self._cond:
            for i, key in enumerate(keys):
                if self._take_failure() or outside(key):
                    failed.append(i)
                elif key in self._values.data:
                    self._values.data.move_to_end(key)
                elif self._values.make_room(len(value := read(i)), self._locked):
                    self._values.data[key] = value
                else:
                    failed.append(i)
        return JobResult(job_id, tuple(failed))

    def submit_retrieve(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        check_items(items, len(self._host))
        return self._submit(partial(self._retrieve, session, tuple(items), _outside(chain)))

    def _retrieve(
        self,
        session: RequestId,
        items: tuple[StoreItem, ...],
        outside: Callable[[ChunkKey], bool],
        job_id: JobId,
    ) -> JobResult:
        with self._cond:
            failed = copy_out(self._host, items, partial(self._value, outside), self._take_failure)
            self._release(session, [item.key for item in items])
        return JobResult(job_id, failed)

    def _value(self, outside: Callable[[ChunkKey], bool], key: ChunkKey) -> bytes | None:
        return None if outside(key) else self._values.data.get(key)

    def _release(self, session: RequestId, keys: Sequence[ChunkKey]) -> None:
        """Release the session's lock on each of ``keys`` it holds (a retrieve read them)."""
        held = self._locks.get(session)
        if held is not None:
            held.subtract(key for key in keys if held[key])
            self._locks[session] = +held

    def end_session(self, session: RequestId) -> None:
        with self._cond:
            self._locks.pop(session, None)

    def close(self) -> None:
        with self._cond:
            super().close()
            self._lookups.clear()


def _outside(chain: Sequence[ChunkKey]) -> Callable[[ChunkKey], bool]:
    """Whether a key lies outside ``chain``: never for an empty chain (the items' keys are the chain)."""
    members = frozenset(chain)
    return lambda key: bool(members) and key not in members


class InMemoryBlockTransferTier(InMemoryManagedTier):
    """An ``InMemoryManagedTier`` that also moves chunks straight between its values and the engine
    blocks of ``engine`` (``SupportsBlockTransfer``): a value is ``blocks_per_chunk`` engine blocks, in
    the byte form of host blocks, one after another.

    Its jobs run in submission order on the tier's lane, so no ``mark`` is needed, each whole under the
    tier's lock: ``abandon`` finds a job not started or finished, never copying. A failed retrieve item's
    engine blocks are overwritten with ``POISON``. An abandoned job that has not run yet fails every
    item: a store stores nothing, a retrieve writes no engine block (and releases its locks).
    """

    def __init__(
        self,
        host: bytearray,
        capacity: int | None = None,
        *,
        engine: InMemoryBlockMover,
        blocks_per_chunk: int,
    ) -> None:
        super().__init__(host, capacity)
        check_positive("blocks_per_chunk", blocks_per_chunk)
        self._engine = engine
        self.blocks_per_chunk = blocks_per_chunk
        self._unfinished: set[JobId] = set()  # block jobs not run yet
        self._abandoned: set[JobId] = set()

    def submit_store_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        items = tuple(items)
        self._check_blocks(items, whole=True)
        keys = tuple(item.key for item in items)
        store = partial(self._store, keys, partial(self._read_blocks, items), _outside(chain))
        return self._submit_block_job(store, len(items), lambda: None)

    def _submit_block_job(self, work: Work, count: int, on_abandon: Callable[[], None]) -> JobId:
        with self._cond:
            job_id = self._submit(partial(self._unless_abandoned, count, work, on_abandon))
            self._unfinished.add(job_id)
            return job_id

    def _read_blocks(self, items: tuple[BlockItem, ...], i: int) -> bytes:
        return b"".join(self._engine.read_engine_block(block) for block in items[i].engine_blocks)

    def _unless_abandoned(
        self, count: int, work: Work, on_abandon: Callable[[], None], job_id: JobId
    ) -> JobResult:
        with self._cond:
            self._unfinished.discard(job_id)
            if job_id in self._abandoned:
                self._abandoned.discard(job_id)
                on_abandon()
                return JobResult(job_id, tuple(range(count)), "abandoned before its copies ran")
            return work(job_id)

    def submit_retrieve_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        items = tuple(items)
        self._check_blocks(items, whole=False)
        retrieve = partial(self._retrieve_blocks, session, items, _outside(chain))
        return self._submit_block_job(
            retrieve, len(items), partial(self._release, session, [i.key for i in items])
        )

    def _retrieve_blocks(
        self,
        session: RequestId,
        items: tuple[BlockItem, ...],
        outside: Callable[[ChunkKey], bool],
        job_id: JobId,
    ) -> JobResult:
        size = self._engine.host_block_bytes
        failed: list[int] = []
        with self._cond:
            for i, item in enumerate(items):
                value = self._value(outside, item.key)
                length = size * (item.value_blocks or self.blocks_per_chunk)
                if self._take_failure() or value is None or len(value) != length:
                    failed.append(i)
                    value = bytes([POISON]) * length
                for n, block in enumerate(item.engine_blocks, start=item.first):
                    self._engine.write_engine_block(block, value[n * size : (n + 1) * size])
            self._release(session, [item.key for item in items])
        return JobResult(job_id, tuple(failed))

    def abandon(self, job_id: JobId) -> bool:
        with self._cond:
            if job_id in self._unfinished:
                self._abandoned.add(job_id)
        return False  # a job runs whole under the lock taken here: none is copying now

    def _check_blocks(self, items: Sequence[BlockItem], *, whole: bool) -> None:
        """Refuse, before anything is queued, items that are no whole value (a store) or no part of one
        (a chunk, or a tail of ``value_blocks``), or that name engine blocks out of range."""
        bound = self._engine.num_engine_blocks
        for i, item in enumerate(items):
            count = len(item.engine_blocks)
            size = item.value_blocks or self.blocks_per_chunk
            if size > self.blocks_per_chunk:
                raise InvalidSpecError(
                    f"items[{i}] ({item.key}): value_blocks {size}, chunks have {self.blocks_per_chunk}"
                )
            if (whole and (item.first or count != size)) or count < 1 or item.first + count > size:
                raise InvalidSpecError(
                    f"items[{i}] ({item.key}): blocks [{item.first}, {item.first + count}) of a value of "
                    f"{size}" + (" (a store moves whole values)" if whole else "")
                )
            bad = [b for b in item.engine_blocks if not 0 <= b < bound]
            if bad:
                raise InvalidSpecError(f"items[{i}] ({item.key}): engine_blocks {bad} outside [0, {bound})")
