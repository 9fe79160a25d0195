"""In-memory reference implementations of every port: simple, obviously right, and free of pytest.

They are the fakes that unit tests of the core hand in, and the executable reading of each port's
contract that the conformance suite is written against. Each also offers the test hooks of
``kvcore.testing.capabilities``: ``fail_next`` (the next items fail), ``stall`` (jobs stay in flight)
and, when built with one, a capacity.

Jobs run in submission order on a ``JobLane`` (``kvcore.lane``), whose thread the first ``submit`` starts
and which ends once the backend is dropped: nothing runs at import or construction, and ``submit``
returns before anything is copied. ``close`` refuses new work as each port says; jobs queued before it
still run. Stalls and failures are ``InjectedFaults`` (``kvcore.testing.faults``),
the implementation every conformance harness shares. A failed item's destination is overwritten with
``POISON`` bytes ("undefined"), so that a caller that uses it anyway is caught by its own tests.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import ClassVar

from kvcore.errors import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    InvalidSpecError,
    KVCoreError,
    UsageError,
)
from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.jobs import JobBoard, JobResult
from kvcore.lane import JobLane
from kvcore.ports import BlockItem, BlockTransfer, ByteCopy, Direction, MemoryRegion, StoreItem
from kvcore.testing.faults import InjectedFaults

__all__ = [
    "POISON",
    "InMemoryAddressSpace",
    "InMemoryBlockMover",
    "InMemoryBlockTransferTier",
    "InMemoryChunkIndex",
    "InMemoryChunkStore",
    "InMemoryManagedTier",
    "InMemoryPeerTransport",
]

POISON = 0xA5
"""The byte written over the destination of a failed item."""

_Work = Callable[[JobId], JobResult]


def _check_positive(name: str, value: int | None, expected: str = "an integer >= 1") -> None:
    if value is not None and value < 1:
        raise ConfigError(name, value, expected)


class _Gate:
    """Stalls and injected failures, shared by every reference backend.

    One re-entrant condition guards the backend's own state: a reference backend does one thing at a
    time, which is what makes it obviously right.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._faults = InjectedFaults()

    def fail_next(self, count: int) -> None:
        """The next ``count`` items processed fail (see ``SupportsFailureInjection``)."""
        self._faults.fail_next(count)

    def stall(self) -> AbstractContextManager[None]:
        """While inside, queued jobs and pending lookups do not finish."""
        return self._faults.stall()

    def _take_failure(self) -> bool:
        return self._faults.take(1) == 1


class _Jobs(_Gate):
    """Jobs in submission order on a ``JobLane``, with results handed out by a ``JobBoard``.

    ``close`` refuses later submits with ``refused_after_close`` (the port's error); jobs queued before
    it still run.
    """

    refused_after_close: ClassVar[type[KVCoreError]] = UsageError

    def __init__(self) -> None:
        super().__init__()
        self._board = JobBoard()
        self._lane = JobLane(f"{type(self).__name__}-jobs")
        self._closed = False

    def close(self) -> None:
        with self._cond:
            self._closed = True

    def _check_open(self, call: str) -> None:
        with self._cond:
            if self._closed:
                raise self.refused_after_close(f"{call}: this {type(self).__name__} is closed")

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def _submit(self, work: _Work) -> JobId:
        with self._cond:
            self._check_open("submit")
            job_id = self._board.new()
            self._lane.submit(partial(self._run, job_id, work), partial(self._fail, job_id))
            return job_id

    def _run(self, job_id: JobId, work: _Work) -> None:
        self._faults.wait_released()
        self._board.finish(work(job_id))

    def _fail(self, job_id: JobId, why: str) -> None:
        """A job whose work raised: a bug in the reference, which the lane logs; the job still ends."""
        self._board.finish(JobResult(job_id, error=why))


def _check_items(items: Sequence[StoreItem], host_size: int) -> None:
    for i, item in enumerate(items):
        if item.offset < 0 or item.length < 1 or item.offset + item.length > host_size:
            raise InvalidSpecError(
                f"item {i} ({item.key}) spans [{item.offset}, {item.offset + item.length}), "
                f"outside the host buffer of {host_size} bytes"
            )


class _Values:
    """Values by key, least recently used first, under an optional bound in bytes.

    ``reserved`` counts bytes promised to puts in flight: they take room but cannot be evicted.
    """

    def __init__(self, capacity: int | None) -> None:
        _check_positive("capacity", capacity, "a number of bytes >= 1, or None for no bound")
        self.capacity = capacity
        self.data: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self.reserved: dict[ChunkKey, int] = {}

    def used(self) -> int:
        return sum(map(len, self.data.values())) + sum(self.reserved.values())

    def make_room(self, length: int, protected: Callable[[ChunkKey], bool]) -> bool:
        """Evict unprotected values, oldest first, until ``length`` more bytes fit; False (evicting
        nothing) when they cannot."""
        if self.capacity is None:
            return True
        victims = [k for k in self.data if not protected(k)]
        evictable = sum(len(self.data[k]) for k in victims)
        if self.used() - evictable + length > self.capacity:
            return False
        for key in victims:
            if self.used() + length <= self.capacity:
                break
            del self.data[key]
        return True


# -- scheduler side ------------------------------------------------------------------------------------


class InMemoryChunkIndex(_Gate):
    """A set of keys answering ``ChunkIndex`` and ``SupportsImmediateLookup``.

    Optionally bounded to ``capacity`` keys: adding to a full index evicts the least recently added (or
    re-added) key that is not pinned; when every key is pinned the new key is refused. Submitted lookups
    are answered from the keys held when they are polled. Once closed, it answers none
    (``BackendUnavailable``); the immediate ``lookup`` still answers.
    """

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        _check_positive("capacity", capacity, "a number of keys >= 1, or None for no bound")
        self.capacity = capacity
        self._keys: OrderedDict[ChunkKey, None] = OrderedDict()
        self._pins: Counter[ChunkKey] = Counter()
        self._lookups: dict[LookupId, tuple[tuple[ChunkKey, ...], ...]] = {}
        self._ids = itertools.count(1)
        self._closed = False

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
        return sum(1 for _ in itertools.takewhile(lambda c: all(k in self._keys for k in c), chunks))

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """Record ``chunks``, answered when polled; keys stand alone here, so ``preceding`` is ignored."""
        with self._cond:
            _check_answering(self._closed, self)
            lookup_id = LookupId(next(self._ids))
            self._lookups[lookup_id] = tuple(tuple(c) for c in chunks)
            return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        """The answer, once; ``UsageError`` for an id that is unknown, cancelled or already answered."""
        with self._cond:
            _check_answering(self._closed, self)
            if lookup_id not in self._lookups:
                raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
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


def _check_answering(closed: bool, owner: object) -> None:
    """A closed index or tier answers no lookup (``ChunkIndex.close``)."""
    if closed:
        raise BackendUnavailable(f"this {type(owner).__name__} is closed: it answers no lookup")


# -- worker side ---------------------------------------------------------------------------------------


class InMemoryBlockMover(_Jobs):
    """Engine KV memory (one ``bytearray`` per layer) and host memory (one ``bytearray``), as blocks.

    An engine block is ``layer_block_bytes`` in each layer; a host block holds one engine block of every
    layer, layer after layer (``host_block_bytes`` in all).
    """

    def __init__(
        self, *, num_engine_blocks: int, num_host_blocks: int, layer_block_bytes: int, num_layers: int = 1
    ) -> None:
        super().__init__()
        for name, value in [
            ("num_engine_blocks", num_engine_blocks),
            ("num_host_blocks", num_host_blocks),
            ("layer_block_bytes", layer_block_bytes),
            ("num_layers", num_layers),
        ]:
            _check_positive(name, value)
        self.num_engine_blocks = num_engine_blocks
        self.num_host_blocks = num_host_blocks
        self.layer_block_bytes = layer_block_bytes
        self.host_block_bytes = layer_block_bytes * num_layers
        self._engine = tuple(bytearray(num_engine_blocks * layer_block_bytes) for _ in range(num_layers))
        self._host = bytearray(num_host_blocks * self.host_block_bytes)

    @property
    def host(self) -> bytearray:
        """The host memory itself, to register with a store that fills and drains it."""
        return self._host

    def submit(self, transfer: BlockTransfer) -> JobId:
        return self.submit_after(transfer, None)

    def mark(self) -> None:
        """No mark is needed: the engine's writes to ``bytearray``s are done when it calls kvcore."""

    def submit_after(self, transfer: BlockTransfer, mark: object) -> JobId:
        """``submit`` (``OrderedMover``): jobs run in submission order, whichever thread submits them."""
        for name, blocks, bound in [
            ("engine_blocks", transfer.engine_blocks, self.num_engine_blocks),
            ("host_blocks", transfer.host_blocks, self.num_host_blocks),
        ]:
            bad = [b for b in blocks if not 0 <= b < bound]
            if bad:
                raise InvalidSpecError(f"{name} {bad} outside [0, {bound})")
        pairs = tuple(zip(transfer.engine_blocks, transfer.host_blocks, strict=True))
        return self._submit(partial(self._copy, transfer.direction, pairs))

    def _copy(self, direction: Direction, pairs: tuple[tuple[int, int], ...], job_id: JobId) -> JobResult:
        failed: list[int] = []
        with self._cond:
            for i, (engine_block, host_block) in enumerate(pairs):
                if self._take_failure():
                    failed.append(i)
                    poison = bytes([POISON]) * self.host_block_bytes
                    if direction is Direction.SAVE:
                        self._write_host(host_block, poison)
                    else:
                        self._write_engine(engine_block, poison)
                elif direction is Direction.SAVE:
                    self._write_host(host_block, self._read_engine(engine_block))
                else:
                    self._write_engine(engine_block, self._read_host(host_block))
        return JobResult(job_id, tuple(failed))

    def _engine_span(self, block: int) -> slice:
        return slice(block * self.layer_block_bytes, (block + 1) * self.layer_block_bytes)

    def _host_span(self, block: int) -> slice:
        return slice(block * self.host_block_bytes, (block + 1) * self.host_block_bytes)

    def _read_engine(self, block: int) -> bytes:
        return b"".join(layer[self._engine_span(block)] for layer in self._engine)

    def _write_engine(self, block: int, data: bytes) -> None:
        step = self.layer_block_bytes
        for n, layer in enumerate(self._engine):
            layer[self._engine_span(block)] = data[n * step : (n + 1) * step]

    def _read_host(self, block: int) -> bytes:
        return bytes(self._host[self._host_span(block)])

    def _write_host(self, block: int, data: bytes) -> None:
        self._host[self._host_span(block)] = data

    # Out-of-band access, for tests: an engine block reads as the bytes a host block would hold.

    def read_engine_block(self, block: int) -> bytes:
        with self._cond:
            return self._read_engine(block)

    def write_engine_block(self, block: int, data: bytes) -> None:
        self._check_block_bytes(data)
        with self._cond:
            self._write_engine(block, data)

    def read_host_block(self, block: int) -> bytes:
        with self._cond:
            return self._read_host(block)

    def write_host_block(self, block: int, data: bytes) -> None:
        self._check_block_bytes(data)
        with self._cond:
            self._write_host(block, data)

    def _check_block_bytes(self, data: bytes) -> None:
        if len(data) != self.host_block_bytes:
            raise InvalidSpecError(f"a block is {self.host_block_bytes} bytes, got {len(data)}")


class InMemoryChunkStore(_Jobs):
    """A dict of values over one registered host ``bytearray``, optionally bounded in bytes.

    A put reserves room when submitted, evicting the least recently used values that no get in flight
    reads (leased); an item that finds no room fails. ``clear`` fails the puts in flight, so none
    resurrects a value after it.
    """

    def __init__(self, host: bytearray, capacity: int | None = None) -> None:
        super().__init__()
        self._host = host
        self._values = _Values(capacity)
        self._leases: Counter[ChunkKey] = Counter()
        self._generation = 0

    @property
    def capacity(self) -> int | None:
        return self._values.capacity

    def __len__(self) -> int:
        """Values held."""
        with self._cond:
            return len(self._values.data)

    def exists(self, keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
        with self._cond:
            return tuple(k in self._values.data for k in keys)

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        _check_items(items, len(self._host))
        items = tuple(items)
        with self._cond:
            reserved: list[int] = []
            for i, item in enumerate(items):
                if item.key in self._values.data or item.key in self._values.reserved:
                    continue
                if self._values.make_room(item.length, lambda k: self._leases[k] > 0):
                    self._values.reserved[item.key] = item.length
                    reserved.append(i)
            work = partial(self._put, items, frozenset(reserved), self._generation)
            return self._submit(work)

    def _put(
        self, items: tuple[StoreItem, ...], reserved: frozenset[int], generation: int, job_id: JobId
    ) -> JobResult:
        failed: list[int] = []
        with self._cond:
            for i, item in enumerate(items):
                if i in reserved:
                    del self._values.reserved[item.key]
                injected = self._take_failure()
                present = item.key in self._values.data
                if injected or (i not in reserved and not present) or generation != self._generation:
                    failed.append(i)
                elif not present:
                    self._values.data[item.key] = bytes(self._host[item.offset : item.offset + item.length])
        return JobResult(job_id, tuple(failed))

    def submit_get(self, items: Sequence[StoreItem]) -> JobId:
        _check_items(items, len(self._host))
        items = tuple(items)
        with self._cond:
            leased = [item.key for item in items if item.key in self._values.data]
            self._leases.update(leased)
            for key in leased:
                self._values.data.move_to_end(key)
            return self._submit(partial(self._get, items, tuple(leased)))

    def _get(self, items: tuple[StoreItem, ...], leased: tuple[ChunkKey, ...], job_id: JobId) -> JobResult:
        with self._cond:
            failed = _copy_out(self._host, items, self._values.data.get, self._take_failure)
            self._leases.subtract(leased)
            self._leases = +self._leases
        return JobResult(job_id, failed)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        with self._cond:
            for key in keys:
                self._values.data.pop(key, None)

    def clear(self) -> None:
        with self._cond:
            self._values.data.clear()
            self._generation += 1

    # Out-of-band access, for tests.

    def peek(self, key: ChunkKey) -> bytes | None:
        with self._cond:
            return self._values.data.get(key)

    def poke(self, key: ChunkKey, value: bytes) -> None:
        """Set a value directly (the most recent; no capacity check)."""
        with self._cond:
            self._values.data[key] = bytes(value)
            self._values.data.move_to_end(key)


def _copy_out(
    host: bytearray,
    items: Sequence[StoreItem],
    value_of: Callable[[ChunkKey], bytes | None],
    take_failure: Callable[[], bool],
) -> tuple[int, ...]:
    """Copy each item's value into its host bytes; poison and list the misses and failures."""
    failed: list[int] = []
    for i, item in enumerate(items):
        span = slice(item.offset, item.offset + item.length)
        value = value_of(item.key)
        if take_failure() or value is None or len(value) != item.length:
            failed.append(i)
            host[span] = bytes([POISON]) * item.length
        else:
            host[span] = value
    return tuple(failed)


class InMemoryManagedTier(_Jobs):
    """A tier that owns its memory: values over one host ``bytearray``, sessions that lock lookup hits.

    A lookup locks its hits for the session; a retrieve releases the session's lock on what it read and
    ``end_session`` releases the rest. Storing into a full tier evicts the least recently used unlocked
    values; an item that finds no room fails. There is no remove. It keys chunks alone: a chain only
    fails the items whose keys it lacks, as the port requires. Once closed, it refuses every submit with
    ``BackendUnavailable`` and drops its pending lookups.
    """

    refused_after_close = BackendUnavailable

    def __init__(self, host: bytearray, capacity: int | None = None) -> None:
        super().__init__()
        self._host = host
        self._values = _Values(capacity)
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
            _check_answering(self._closed, self)
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
            _check_answering(self._closed, self)
            if lookup_id not in self._lookups:
                raise UsageError(f"lookup {lookup_id} is unknown or already answered")
            if self._faults.stalled:
                return None
            return self._lookups.pop(lookup_id)

    def submit_store(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        _check_items(items, len(self._host))
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
        _check_items(items, len(self._host))
        return self._submit(partial(self._retrieve, session, tuple(items), _outside(chain)))

    def _retrieve(
        self,
        session: RequestId,
        items: tuple[StoreItem, ...],
        outside: Callable[[ChunkKey], bool],
        job_id: JobId,
    ) -> JobResult:
        with self._cond:
            failed = _copy_out(self._host, items, partial(self._value, outside), self._take_failure)
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

    # Out-of-band access, for tests.

    def peek(self, key: ChunkKey) -> bytes | None:
        with self._cond:
            return self._values.data.get(key)

    def poke(self, key: ChunkKey, value: bytes) -> None:
        """Set a value directly (the most recent; no capacity check)."""
        with self._cond:
            self._values.data[key] = bytes(value)
            self._values.data.move_to_end(key)


def _outside(chain: Sequence[ChunkKey]) -> Callable[[ChunkKey], bool]:
    """Whether a key lies outside ``chain``: never for an empty chain (the items' keys are the chain)."""
    members = frozenset(chain)
    return lambda key: bool(members) and key not in members


class InMemoryBlockTransferTier(InMemoryManagedTier):
    """An ``InMemoryManagedTier`` that also moves chunks straight between its values and the engine
    blocks of ``engine`` (``SupportsBlockTransfer``): a value is ``blocks_per_chunk`` engine blocks, in
    the byte form of host blocks, one after another.

    Its jobs run in submission order on the tier's lane, so no ``mark`` is needed. A failed retrieve
    item's engine blocks are overwritten with ``POISON``. An abandoned store job that has not run yet
    stores nothing and fails every item.
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
        _check_positive("blocks_per_chunk", blocks_per_chunk)
        self._engine = engine
        self.blocks_per_chunk = blocks_per_chunk
        self._unfinished: set[JobId] = set()  # block stores not run yet
        self._abandoned: set[JobId] = set()

    def submit_store_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        items = tuple(items)
        self._check_blocks(items, whole=True)
        keys = tuple(item.key for item in items)
        store = partial(self._store, keys, partial(self._read_blocks, items), _outside(chain))
        with self._cond:
            job_id = self._submit(partial(self._store_unless_abandoned, len(items), store))
            self._unfinished.add(job_id)
            return job_id

    def _read_blocks(self, items: tuple[BlockItem, ...], i: int) -> bytes:
        return b"".join(self._engine.read_engine_block(block) for block in items[i].engine_blocks)

    def _store_unless_abandoned(self, count: int, store: _Work, job_id: JobId) -> JobResult:
        with self._cond:
            self._unfinished.discard(job_id)
            if job_id in self._abandoned:
                self._abandoned.discard(job_id)
                return JobResult(job_id, tuple(range(count)), "abandoned before its copies ran")
            return store(job_id)

    def submit_retrieve_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        items = tuple(items)
        self._check_blocks(items, whole=False)
        return self._submit(partial(self._retrieve_blocks, session, items, _outside(chain)))

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
                if self._take_failure() or value is None or len(value) != size * self.blocks_per_chunk:
                    failed.append(i)
                    value = bytes([POISON]) * size * self.blocks_per_chunk
                for n, block in enumerate(item.engine_blocks, start=item.first):
                    self._engine.write_engine_block(block, value[n * size : (n + 1) * size])
            self._release(session, [item.key for item in items])
        return JobResult(job_id, tuple(failed))

    def abandon(self, job_id: JobId) -> None:
        with self._cond:
            if job_id in self._unfinished:
                self._abandoned.add(job_id)

    def _check_blocks(self, items: Sequence[BlockItem], *, whole: bool) -> None:
        """Refuse, before anything is queued, items that are no whole chunk (a store) or no part of one,
        or that name engine blocks out of range."""
        size, bound = self.blocks_per_chunk, self._engine.num_engine_blocks
        for i, item in enumerate(items):
            count = len(item.engine_blocks)
            if (whole and (item.first or count != size)) or count < 1 or item.first + count > size:
                raise InvalidSpecError(
                    f"items[{i}] ({item.key}): blocks [{item.first}, {item.first + count}) of a chunk of "
                    f"{size}" + (" (a store moves whole chunks)" if whole else "")
                )
            bad = [b for b in item.engine_blocks if not 0 <= b < bound]
            if bad:
                raise InvalidSpecError(f"items[{i}] ({item.key}): engine_blocks {bad} outside [0, {bound})")


class InMemoryAddressSpace:
    """Fake process memory shared by the ``InMemoryPeerTransport``s built on it.

    Allocations get addresses that never touch (a gap separates them), so a copy that strays out of
    one is caught. Each transport's registered regions are listed under its peer name.
    """

    _GAP = 0x1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._memory: dict[int, bytearray] = {}
        self._next = self._GAP
        self._registered: dict[str, list[MemoryRegion]] = {}

    def allocate(self, length: int) -> MemoryRegion:
        """A new zeroed span of ``length`` bytes."""
        _check_positive("length", length)
        with self._lock:
            address = self._next
            self._memory[address] = bytearray(length)
            self._next += length + self._GAP
            return MemoryRegion(address, length)

    def read(self, address: int, length: int) -> bytes:
        memory, start = self._locate(address, length)
        return bytes(memory[start : start + length])

    def write(self, address: int, data: bytes) -> None:
        memory, start = self._locate(address, len(data))
        memory[start : start + len(data)] = data

    def holds(self, address: int, length: int) -> bool:
        """Whether ``[address, address + length)`` lies inside one allocation."""
        return self._find(address, length) is not None

    def view(self, region: MemoryRegion) -> memoryview:
        """A writable view sharing the bytes of ``region`` (inside one allocation): out-of-band access
        for a test that lays structured data over it (``torch.frombuffer``). Raises
        ``InvalidSpecError`` outside allocated memory."""
        memory, start = self._locate(region.address, region.length)
        return memoryview(memory)[start : start + region.length]

    def _find(self, address: int, length: int) -> tuple[bytearray, int] | None:
        with self._lock:
            for base, memory in self._memory.items():
                if length >= 1 and base <= address and address + length <= base + len(memory):
                    return memory, address - base
        return None

    def _locate(self, address: int, length: int) -> tuple[bytearray, int]:
        found = self._find(address, length)
        if found is None:
            raise InvalidSpecError(f"[{address:#x}, +{length}) is not allocated memory")
        return found

    def _join(self, name: str) -> None:
        with self._lock:
            if name in self._registered:
                raise ConfigError("name", name, "a peer name not yet used in this address space")
            self._registered[name] = []

    def _register(self, name: str, regions: Sequence[MemoryRegion]) -> None:
        with self._lock:
            self._registered[name].extend(regions)

    def _unregister(self, name: str, regions: Sequence[MemoryRegion] | None) -> None:
        """Drop ``name``'s registrations that one of ``regions`` covers (``None``: all of them)."""
        with self._lock:
            self._registered[name] = [
                r
                for r in self._registered[name]
                if regions is not None
                and not any(
                    g.address <= r.address and r.address + r.length <= g.address + g.length for g in regions
                )
            ]

    def _regions_of(self, peer: str) -> tuple[MemoryRegion, ...] | None:
        with self._lock:
            regions = self._registered.get(peer)
            return None if regions is None else tuple(regions)


class InMemoryPeerTransport(_Jobs):
    """Pushes bytes between transports that share one ``InMemoryAddressSpace``; its ``address`` is the
    name it is built with.

    A write to an unknown peer fails every copy; a copy whose destination the peer has not registered
    fails; a source outside allocated memory is refused at submit (sources need no registration).
    ``close`` withdraws the registrations at once; jobs queued before it still run.
    """

    def __init__(self, space: InMemoryAddressSpace, name: str) -> None:
        super().__init__()
        space._join(name)
        self._space = space
        self.address = name

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        bad = [r for r in regions if not self._space.holds(r.address, r.length)]
        if bad:
            raise InvalidSpecError(f"regions {bad} are not allocated memory; nothing registered")
        with self._cond:
            self._check_open("register")
            self._space._register(self.address, regions)

    def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self._space._unregister(self.address, regions)

    def submit_write(self, peer: str, copies: Sequence[ByteCopy]) -> JobId:
        bad = [c for c in copies if not self._space.holds(c.src, c.length)]
        if bad:
            raise InvalidSpecError(f"copies {bad} read outside allocated memory; nothing copied")
        with self._cond:
            self._check_open("submit_write")
            return self._submit(partial(self._write, peer, tuple(copies)))

    def submit_write_columns(
        self, peer: str, srcs: Collection[int], dsts: Collection[int], lengths: Collection[int]
    ) -> JobId:
        if not len(srcs) == len(dsts) == len(lengths):
            raise InvalidSpecError(
                f"srcs, dsts and lengths: got {len(srcs)}, {len(dsts)} and {len(lengths)} entries, "
                "expected columns of one length"
            )
        copies = [ByteCopy(int(s), int(d), int(n)) for s, d, n in zip(srcs, dsts, lengths, strict=True)]
        return self.submit_write(peer, copies)

    def close(self) -> None:
        with self._cond:
            super().close()
            self._space._unregister(self.address, None)

    def _write(self, peer: str, copies: tuple[ByteCopy, ...], job_id: JobId) -> JobResult:
        regions = self._space._regions_of(peer)
        if regions is None:
            return JobResult(job_id, tuple(range(len(copies))), f"unknown peer {peer!r}")
        failed: list[int] = []
        for i, copy in enumerate(copies):
            registered = any(
                r.address <= copy.dst and copy.dst + copy.length <= r.address + r.length for r in regions
            )
            if self._take_failure() or not registered:
                failed.append(i)
                if registered:
                    self._space.write(copy.dst, bytes([POISON]) * copy.length)
            else:
                self._space.write(copy.dst, self._space.read(copy.src, copy.length))
        return JobResult(job_id, tuple(failed))
