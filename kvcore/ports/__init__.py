"""The ports: what kvcore needs from the world outside, as ``typing.Protocol``s grouped by side.

Scheduler side (decides, indexes, never touches KV bytes): ``ChunkIndex``, its optional immediate form
``SupportsImmediateLookup`` and ``SupportsHeldLookups`` (lookups whose read locks the workers' load
takes over, with ``SupportsAdoptedLocks`` on the worker side).

Worker side (owns memory, executes jobs): ``BlockMover`` (engine KV <-> host blocks), ``ChunkStore`` (a
content-addressed remote tier the client fills and drains), ``ManagedTier`` (a tier that manages its own
memory and sessions) and ``PeerTransport`` (prefill -> decode pushes).

Every asynchronous method hands out a ``JobId``; results come back once through ``poll`` or ``wait``.
Each method says what state a failure leaves. Implementations map their native failures to
``kvcore.errors`` at their edge; nothing else may escape them. Every port that holds threads, sockets or
memory ends with ``close``: idempotent, it refuses new work and says what becomes of the work in flight.

One module on purpose, though it is long: it is the whole contract a backend author reads, and every
port's docstring is its specification (the conformance suite checks what they say).
"""

from __future__ import annotations

import enum
import mmap
from collections.abc import Collection, Iterable, Sequence
from typing import Protocol, runtime_checkable

from attrs import Attribute, field, frozen
from attrs.validators import ge, optional

from kvcore.checks import block_id, instance
from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.jobs import JobResult

__all__ = [
    "BlockItem",
    "BlockMover",
    "BlockMovers",
    "BlockRemote",
    "BlockTransfer",
    "ByteCopy",
    "ChunkIndex",
    "ChunkStore",
    "Direction",
    "HeldChunks",
    "JobQueue",
    "ManagedTier",
    "MemoryRegion",
    "OrderedMover",
    "PeerTransport",
    "RankMemory",
    "RemoteTier",
    "StoreItem",
    "SupportsAdoptedLocks",
    "SupportsBlockTransfer",
    "SupportsClear",
    "SupportsDeviceOrder",
    "SupportsHeldLookups",
    "SupportsImmediateLookup",
    "SupportsReopen",
    "SupportsTierUsage",
    "SupportsWriteBack",
    "TierUsage",
]


class Direction(enum.Enum):
    """Which way a block copy goes."""

    SAVE = "save"  # engine KV -> host
    LOAD = "load"  # host -> engine KV


class _NotIds:
    """What ``int_tuple`` makes of a value that is not a collection of ids, for ``int_ids`` to refuse
    with the field's name (a converter does not know it)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    """Converter for integer-id fields: any iterable in, a tuple out (values stay hashable); pair it with
    the ``int_ids`` validator, which refuses what is not an integer id (a lone value, a string, None)."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        return (_NotIds(values),)  # type: ignore[return-value]  # int_ids refuses it, by name
    return tuple(values)


def int_ids(_: object, attribute: Attribute[tuple[int, ...]], value: tuple[int, ...]) -> None:
    """Validator of an integer-id field (after ``converter=tuple``): a bool, float or string among the
    ids is refused with ``InvalidSpecError`` naming the field, never truncated."""
    for item in value:
        block_id(attribute.name, item)


def _same_length(instance: BlockTransfer, attribute: object, value: tuple[int, ...]) -> None:
    if len(value) != len(instance.engine_blocks):
        raise InvalidSpecError(
            f"host_blocks has {len(value)} entries, engine_blocks {len(instance.engine_blocks)}"
        )


@frozen
class BlockTransfer:
    """Copy whole blocks: ``engine_blocks[i]`` <-> ``host_blocks[i]``, for every layer of the shard.

    A host block holds one engine block of every layer, layer after layer; a host slot (one chunk) is
    ``blocks_per_chunk`` consecutive host blocks.
    """

    direction: Direction = field(validator=instance(Direction))
    engine_blocks: tuple[int, ...] = field(converter=int_tuple, validator=int_ids)
    host_blocks: tuple[int, ...] = field(converter=int_tuple, validator=[int_ids, _same_length])


@frozen
class StoreItem:
    """One value of a chunk store: a key and the host bytes ``[offset, offset + length)`` it maps to."""

    key: ChunkKey
    offset: int
    length: int


def _holders(_: object, attribute: Attribute[tuple[str, ...]], value: object) -> None:
    if not isinstance(value, tuple) or not value or not all(h and isinstance(h, str) for h in value):
        raise InvalidSpecError(
            f"HeldChunks.{attribute.name}: a tuple of one non-empty name per rank, got {value!r}"
        )


def _chunk_position(_: object, attribute: Attribute[int], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidSpecError(f"HeldChunks.{attribute.name}: a chunk position (an int >= 0), got {value!r}")


def _after_start(owner: HeldChunks, attribute: Attribute[int], value: int) -> None:
    if value <= owner.start:
        raise InvalidSpecError(f"HeldChunks.{attribute.name}: must exceed start ({owner.start}), got {value}")


@frozen
class HeldChunks:
    """Chunks ``[start, end)`` of a request's chain that a remote index's lookup keeps read-locked, for
    each rank under the name ``holders[rank]`` (opaque to the core: the tier's name of the lock's owner).

    The scheduler hands them to the workers with the request's load (``BlockOp.held``): each rank's tier
    reads those chunks without a lookup of its own and releases what it does not read
    (``SupportsAdoptedLocks``). Or it releases them itself, unread (``SupportsHeldLookups``).
    """

    holders: tuple[str, ...] = field(validator=_holders)
    start: int = field(validator=_chunk_position)
    end: int = field(validator=[_chunk_position, _after_start])


@frozen
class BlockItem:
    """One chunk that a tier moves straight between its own memory and engine blocks.

    ``engine_blocks[i]`` holds block ``first + i`` of the chunk (a store moves whole values: ``first`` is
    0 and every block of the value is given). ``value_blocks``: the key names a *tail*, a value of that
    many blocks (the leading whole blocks of a chunk, fewer than a chunk's); ``None``: a whole chunk.
    """

    key: ChunkKey
    engine_blocks: tuple[int, ...] = field(converter=int_tuple, validator=int_ids)
    first: int = field(default=0, validator=ge(0))
    value_blocks: int | None = field(default=None, validator=optional(ge(1)))


@frozen
class MemoryRegion:
    """A registered span of memory, by address: what a peer may write into."""

    address: int
    length: int


@frozen
class ByteCopy:
    """One contiguous copy from a local address to a peer's address."""

    src: int
    dst: int
    length: int


class JobQueue(Protocol):
    """Completion side shared by every asynchronous port."""

    def poll(self) -> tuple[JobResult, ...]:
        """Results of jobs finished since the last call; never blocks. Each result is handed out once."""
        ...

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        """Block until the given jobs finished and return their results.

        Raises ``TransferTimeout`` after ``timeout`` seconds; unfinished jobs keep running and are
        reported by a later ``poll``/``wait``.
        """
        ...


# -- scheduler side ------------------------------------------------------------------------------------


class ChunkIndex(Protocol):
    """Which leading chunks a tier holds. Answers never block the engine."""

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """Start checking ``chunks`` in order; each chunk is given by the keys of all of its shards.

        ``preceding`` are the request's chunks before ``chunks[0]`` (a nearer tier holds them), in the
        same form. A chained tier needs them (see ``ManagedTier``); the answer counts chunks of
        ``chunks`` only, and a chained tier that lacks a preceding chunk may answer 0.

        Failure: raises ``BackendUnavailable`` when the lookup cannot even start (the caller answers 0).
        """
        ...

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        """How many leading chunks have every shard present, or ``None`` while the lookup is pending.

        A finished answer is handed out once. Failure: raises ``BackendError`` (the caller answers 0).
        """
        ...

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        """Forget a lookup; a late answer is dropped. Unknown ids are ignored."""
        ...

    def close(self) -> None:
        """Stop answering; idempotent.

        Afterwards ``submit_lookup`` raises ``BackendUnavailable`` (the caller answers 0, as for a tier
        that is down), and lookups still pending are dropped: ``poll_lookup`` raises ``BackendError`` for
        them. ``cancel_lookup`` keeps working; an immediate ``lookup`` may still answer.
        """
        ...


@runtime_checkable
class SupportsImmediateLookup(Protocol):
    """An embedded index that answers at once (microseconds), with no submit/poll round."""

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        """How many leading chunks have every shard present. Never raises for a miss."""
        ...


@runtime_checkable
class SupportsHeldLookups(ChunkIndex, Protocol):
    """A ``ChunkIndex`` whose lookups can keep their hits read-locked for the workers' load, so that a
    worker reads them without a lookup of its own (an LMCache server's lookups lock what they find).

    The scheduler owns a held lookup's locks from its answer on, and must end each ``HeldChunks`` it
    takes in exactly one of two ways: ``hand_over`` (the workers' tier takes the locks over) or
    ``release_held``. Locks never ended lapse with the tier's own lock timeout.
    """

    def submit_held_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """As ``ChunkIndex.submit_lookup``, except that each chunk names every rank's key in rank order
        (ranks that share a shard repeat its key: each of them reads it, and each takes a lock), and
        that the chunks the answer counts stay locked for ``take_held``."""
        ...

    def take_held(self, lookup_id: LookupId) -> HeldChunks | None:
        """The locks of a held lookup that ``poll_lookup`` answered, handed out once: the answered
        chunks, at their positions in the request's chain (``preceding`` first). ``None`` when nothing
        is held (a miss, a failed or cancelled lookup, an unknown id)."""
        ...

    def hand_over(self, held: HeldChunks) -> bool:
        """End ``held`` by handing it to the workers: true when they may read under it now; false when
        it is too old for that (its locks may lapse before a worker reads: it is released then), or the
        index is closed (its locks are left to lapse); the workers then lock what they read
        themselves."""
        ...

    def release_held(self, held: HeldChunks) -> None:
        """End ``held`` unread: release its locks. Never raises."""
        ...


# -- worker side ---------------------------------------------------------------------------------------


class BlockMover(JobQueue, Protocol):
    """Copies whole blocks between the engine's KV memory and host memory, per the registered layout."""

    def submit(self, transfer: BlockTransfer) -> JobId:
        """Queue a copy; returns at once.

        Bad block ids or mismatched lengths raise ``InvalidSpecError`` before anything is copied. A copy
        that fails later is reported as a failed result: the destination blocks hold undefined bytes and
        must not be used (loads: recompute them; saves: drop the slot).
        """
        ...

    def close(self) -> None:
        """Stop copying; idempotent.

        Afterwards every submit raises ``UsageError`` and queues nothing. Jobs submitted before still
        finish or fail (a job not started yet may fail at once), and ``poll``/``wait`` report them.
        """
        ...


@runtime_checkable
class SupportsReopen(Protocol):
    """A ``BlockMover`` that can take jobs again after ``close``: a worker that halted its copies
    (``kvcore.execution.worker.BlockWorker.halt``) resumes once the copy that made it halt has ended."""

    def reopen(self) -> bool:
        """Take jobs again, once every job submitted before ``close`` has ended; returns whether it does
        (``False``: one still runs, ask again later; an open mover returns ``True``). Job ids go on from
        where they were, and the results of earlier jobs are still handed out by ``poll``/``wait``."""
        ...


@runtime_checkable
class SupportsDeviceOrder(Protocol):
    """A ``BlockMover`` whose engine queues its work on a device (a CUDA stream): the engine's next work
    can be made to wait for a load on the device, so that the host never waits for the copy before the
    forward pass is queued."""

    @property
    def orders_on_device(self) -> bool:
        """Whether ``wait_loaded`` orders on the device without blocking the host (a CUDA engine); where it
        does not, the host waits for loads itself."""
        ...

    def wait_loaded(self, job_id: JobId, timeout: float) -> None:
        """Order the engine's work queued from now on, on the calling thread, after the load ``job_id``
        (unknown and finished jobs: nothing to order); its result still comes from ``poll``/``wait``."""
        ...


@runtime_checkable
class OrderedMover(BlockMover, Protocol):
    """A ``BlockMover`` whose copies may be submitted from a thread other than the engine's.

    ``submit`` orders a copy after the engine work queued on the calling thread (a CUDA stream); a
    backend that copies on its own thread takes a ``mark`` on the engine's thread instead and submits
    ``after`` it, so that a save never reads blocks the engine is still computing.
    """

    def mark(self) -> object:
        """The engine's queued work so far, seen from the calling thread (``None`` where copies need no
        ordering, as on a CPU engine, whose work is done when the engine calls kvcore)."""
        ...

    def submit_after(self, transfer: BlockTransfer, mark: object) -> JobId:
        """``submit``, ordered after ``mark`` instead of the calling thread's queued work; refused as
        ``submit`` is (after ``close`` included)."""
        ...


class ChunkStore(JobQueue, Protocol):
    """A content-addressed remote tier that the client fills and drains (e.g. Mooncake store).

    Values are read from and written into one host buffer registered with the store at construction.
    """

    def exists(self, keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
        """Which keys are present. Failure: raises ``BackendError``; nothing changed."""
        ...

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        """Store each item's host bytes under its key. Idempotent: a present key keeps its value.

        Failure: the result lists the failed items; those keys are absent or hold their earlier value,
        never a partial one.
        """
        ...

    def submit_get(self, items: Sequence[StoreItem]) -> JobId:
        """Copy each key's value into its host bytes. A missing key, or a value whose length differs
        from the item's, is a failed item (a miss): its host bytes are undefined."""
        ...

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """Drop keys; missing keys are ignored. Failure: raises ``BackendError``; some keys may remain."""
        ...

    def close(self) -> None:
        """Stop moving values; idempotent. The host buffer is the caller's again once it returns.

        Afterwards ``submit_put`` and ``submit_get`` raise ``UsageError`` and queue nothing. Jobs
        submitted before still finish or fail, and ``poll``/``wait`` report them. ``exists`` and
        ``remove`` either still work or raise ``BackendError``.
        """
        ...


class ManagedTier(JobQueue, Protocol):
    """A tier that manages its own memory and sessions (e.g. an LMCache server); it cannot remove.

    A managed tier may be *chained*: it addresses a chunk by the chunks before it in its request (an
    LMCache server hashes each chunk on the previous ones), so that a request's chunks travel as one
    sequence, in one round trip. Every call therefore names the chain: the request's keys from its first
    chunk on. A chunk key stands for its whole prefix, so a key always comes with the same chain; a tier
    that keys chunks alone ignores it.
    """

    def submit_lookup(
        self, session: RequestId, chunks: Sequence[ChunkKey], preceding: Sequence[ChunkKey] = ()
    ) -> LookupId:
        """Start a lookup (and the tier's prefetch) of ``chunks``, the request's chunks after
        ``preceding``, for a session; hits stay locked until retrieved or the session ends.
        Failure: raises ``BackendUnavailable`` (the caller answers 0)."""
        ...

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        """Leading chunks hit, or ``None`` while pending. Failure: raises ``BackendError`` (answer 0)."""
        ...

    def submit_store(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        """Store host bytes under keys. ``chain`` is the request's keys from its first chunk through the
        last item's (empty: the items' keys, in order, are the whole chain); an item whose key is not in
        it fails. Failure: failed items are not stored."""
        ...

    def submit_retrieve(
        self, session: RequestId, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        """Copy locked hits into host bytes; ``chain`` as for ``submit_store``. Failure: failed items'
        host bytes are undefined (recompute)."""
        ...

    def end_session(self, session: RequestId) -> None:
        """Release every lock the session holds. Idempotent; never raises."""
        ...

    def close(self) -> None:
        """Leave the tier; idempotent.

        Afterwards every submit (lookups, stores, retrieves) raises ``BackendUnavailable``, as for a
        tier that is down, and queues nothing; lookups still pending are dropped: ``poll_lookup`` raises
        ``BackendError`` for them. Jobs submitted before still finish or fail, and ``poll``/``wait``
        report them. ``end_session`` keeps working (it never raises).
        """
        ...


@runtime_checkable
class SupportsBlockTransfer(ManagedTier, Protocol):
    """A ``ManagedTier`` whose own memory an engine's blocks can be copied into and out of directly,
    with no host buffer of the engine's between them (an LMCache server's shared-memory slots).

    The tier copies with a block mover over its memory; the calls name the chain as the host-bytes calls
    of ``ManagedTier`` do, and fail items the same way, and are refused after ``close`` as they are.
    Both order their copies after the engine work queued on the calling thread, so they are called on
    the engine's thread.
    """

    def submit_store_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        """Store each item's engine blocks (a whole chunk) under its key. Failure: failed items are not
        stored; the engine blocks are only read."""
        ...

    def submit_retrieve_blocks(
        self, session: RequestId, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        """Copy locked hits into the items' engine blocks. The job finishes only once no copy of it can
        touch an engine block any more. Failure: failed items' engine blocks are undefined (recompute)."""
        ...

    def abandon(self, job_id: JobId) -> bool:
        """The engine gives job ``job_id`` up: its blocks may be freed and overwritten from now on.

        A store whose copies have not finished stores nothing. A retrieve starts no copy into engine
        blocks from now on; its items not yet copied fail. Returns whether a copy of the job into engine
        blocks may still be running (a retrieve whose copy had started): the engine must then keep those
        blocks until the job ends. Unknown or finished jobs are ignored (``False``)."""
        ...


@runtime_checkable
class SupportsAdoptedLocks(ManagedTier, Protocol):
    """A ``ManagedTier`` that takes over locks a scheduler's held lookup took (``SupportsHeldLookups``)."""

    def adopt(self, session: RequestId, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        """Chunks ``[start, end)`` of ``chain`` (the session's chain, at least ``end`` keys) are locked
        under ``holder`` for this rank: the session's next retrieve reads them without a lookup of its
        own, and releases those it does not read once it ends; ``end_session`` releases any left.
        Never raises (a tier that cannot adopt them releases them, or leaves them to lapse)."""
        ...


class PeerTransport(JobQueue, Protocol):
    """Pushes bytes into a peer's registered memory (prefill -> decode).

    Every transport is also a peer: others reach it by its ``address`` and write into the memory it
    registered. It is open once built, until ``close``.
    """

    @property
    def address(self) -> str:
        """The name peers give as ``peer`` to write into this transport's memory; fixed for its life."""
        ...

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Make local memory writable by peers, in addition to what is registered already.

        Failure: raises ``BackendError`` (or ``InvalidSpecError`` for a region it cannot take); nothing
        registered. After ``close``: raises ``UsageError``.
        """
        ...

    def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        """Withdraw the registrations that ``regions`` cover (as given to ``register``); others stay, and
        regions never registered are ignored. Peers' writes into them fail from then on. The caller makes
        sure no job of its own still reads them. Never raises, after ``close`` included."""
        ...

    def submit_write(self, peer: str, copies: Sequence[ByteCopy]) -> JobId:
        """Write local bytes into the peer's registered memory.

        Failure: the result lists the failed copies; their destination bytes are undefined, and the
        consumer must recompute them. A copy that cannot be right (a source outside local memory) may be
        refused at submit with ``InvalidSpecError``, nothing written. After ``close``: raises
        ``UsageError``.
        """
        ...

    def submit_write_columns(
        self, peer: str, srcs: Collection[int], dsts: Collection[int], lengths: Collection[int]
    ) -> JobId:
        """``submit_write`` of copy ``i`` = ``lengths[i]`` bytes from ``srcs[i]`` to ``dsts[i]``: three
        columns of integers (lists, or int64 arrays that a backend may take without copying) instead of
        one object per copy, for writes of many ranges. The result's failed indices index the columns.
        Columns of different lengths raise ``InvalidSpecError``; otherwise as ``submit_write``."""
        ...

    def close(self) -> None:
        """End the transport; idempotent.

        Afterwards ``register``, ``submit_write`` and ``submit_write_columns`` raise ``UsageError`` and
        queue nothing. Jobs submitted before still finish or fail, and ``poll``/``wait`` report them
        (``close`` may wait a bounded time for them). Every registration is withdrawn: peers' writes into
        this transport's memory fail. ``unregister``, ``poll`` and ``wait`` keep working.
        """
        ...


@runtime_checkable
class SupportsClear(Protocol):
    """A tier that can drop everything it holds (a test or operator action, never the hot path)."""

    def clear(self) -> None:
        """Drop every value. Jobs in flight finish or fail; none resurrects a cleared value."""
        ...


@frozen
class TierUsage:
    """How full a tier is: bytes held, the bytes it may hold, and the values it evicted since it was made
    (by every process that shares it)."""

    used_bytes: int
    capacity_bytes: int
    evictions: int


@runtime_checkable
class SupportsTierUsage(Protocol):
    """An index that can tell how full its tier is, cheaply enough to ask every engine step."""

    def usage(self) -> TierUsage:
        """The tier's usage now. Raises ``BackendError`` when the tier cannot tell."""
        ...


# -- the remote tier a rank drives, and what it sees of the rank -----------------------------------------


class RemoteTier(JobQueue, Protocol):
    """Moves chunk values between the remote tier and this rank's host slots."""

    def submit_fetch(self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()) -> JobId:
        """Copy each key's value into its host bytes; a missing or odd-sized value is a failed item.
        ``chain``: the request's keys from its first chunk on, for a chained tier (``ManagedTier``)."""
        ...

    def submit_publish(
        self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        """Store each item's host bytes under its key; a failed item is simply not stored."""
        ...

    def adopt(self, session: str, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        """Take over the locks a scheduler's held lookup keeps for this rank (``SupportsAdoptedLocks``);
        a tier without locks ignores it. Never raises."""
        ...

    def end_session(self, session: str) -> None:
        """The request is over and none of its jobs is in flight: release what the tier holds for it."""
        ...

    def close(self) -> None:
        """Close the tier beneath; idempotent, never raises (a failure is logged).

        Afterwards every submit raises ``UsageError`` and queues nothing (the worker fails its chunks).
        Jobs submitted before still finish or fail, and ``poll``/``wait`` report them; ``end_session``
        keeps working.
        """
        ...


@runtime_checkable
class SupportsWriteBack(RemoteTier, Protocol):
    """A remote tier with tiers written back (``kvcore.config.tiers``): ``submit_publish`` writes a save to the
    tiers written through, ``submit_write_back`` a chunk the pool is about to evict to the others."""

    @property
    def writes_back(self) -> bool:
        """Whether any of its tiers is written back (else ``submit_write_back`` stores nothing)."""
        ...

    def submit_write_back(self, session: str, items: Sequence[StoreItem]) -> JobId:
        """Store each item's host bytes under its key in the tiers written back that admit it (a chunk
        they do not admit is no failure); a failed item is stored in none of them."""
        ...


@runtime_checkable
class BlockRemote(RemoteTier, Protocol):
    """A remote tier that also moves chunks straight between engine blocks and its own memory (chunks
    with no host slot, see ``RemoteChunk``); called on the engine's thread."""

    def submit_fetch_blocks(
        self, session: str, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        """Copy each key's value into its engine blocks; failures as for ``submit_fetch``. Raises
        ``BackendError`` when the tier cannot reach engine blocks."""
        ...

    def submit_publish_blocks(
        self, session: str, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        """Store each item's engine blocks under its key; failures as for ``submit_publish``. Raises
        ``BackendError`` when the tier cannot reach engine blocks."""
        ...

    def abandon(self, job_id: JobId) -> bool:
        """Give a block job up (``SupportsBlockTransfer.abandon``): returns whether a fetch's copy into
        engine blocks may still be running."""
        ...


class BlockMovers(Protocol):
    """Movers between a rank's engine blocks and memory that a remote tier maps itself (an LMCache
    server's shared-memory pool), for a tier that moves engine blocks with no host pool in between."""

    def mark(self) -> object:
        """The engine's work queued so far, taken on the engine's thread (see ``OrderedMover``)."""
        ...

    def over(self, pool: mmap.mmap) -> OrderedMover:
        """A mover between the engine's blocks and ``pool``, as host blocks of the engine's host block
        size. Raises ``BackendError`` when the pool cannot be used (page-locking)."""
        ...


class RankMemory(Protocol):
    """One rank's memory as its remote tier is opened over it (``kvcore.plugins.Backend.open_remote``).

    ``host`` is the rank's host pool, through which every chunk the tier moves is staged, and
    ``host_address`` the address of its first byte (for a native transfer engine to register); both are
    ``None`` when the backend is configured with no host pool (``BackendSettings.DIRECT``), and then
    ``movers`` is how the tier reaches the engine's blocks itself. The memory stays valid until the
    rank's worker is closed, after the tier.
    """

    @property
    def rank(self) -> int: ...

    @property
    def host(self) -> memoryview | None: ...

    @property
    def host_address(self) -> int | None: ...

    @property
    def movers(self) -> BlockMovers: ...
