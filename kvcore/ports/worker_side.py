"""The worker side's ports: what a rank's ``BlockWorker`` drives. A block mover between the engine's KV and
host blocks (``BlockMover``; ``OrderedMover`` for copies submitted off the engine's thread), the remote
tier beyond the host pool (``RemoteTier``; ``BlockRemote`` when it moves engine blocks itself), a
prefill's pushes to a decode engine (``PeerTransport``), and the rank's memory a backend's remote tier is
opened over (``RankMemory``, ``BlockMovers``)."""

from __future__ import annotations

import mmap
from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

from kvcore.ids import ChunkKey, JobId
from kvcore.ports.common import BlockItem, BlockTransfer, ByteCopy, JobQueue, MemoryRegion, StoreItem

__all__ = [
    "BlockMover",
    "BlockMovers",
    "BlockRemote",
    "OrderedMover",
    "PeerTransport",
    "RankMemory",
    "RemoteTier",
    "SupportsDeviceOrder",
    "SupportsReopen",
    "SupportsWriteBack",
]


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
    """A remote tier with tiers written back (``kvcore.config.tiers``): ``submit_publish`` writes a save to
    the tiers written through, ``submit_write_back`` a chunk the pool is about to evict to the others."""

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

    def over(self, pool: mmap.mmap, *, per_head: bool = False) -> OrderedMover:
        """A mover between the engine's blocks and ``pool``, as host blocks of the engine's host block
        size; with ``per_head``, as head blocks (a host block's bytes of one local KV head, its runs one
        after another: ``kvcore.model.head_runs``), and each transfer names its head
        (``BlockTransfer.head``). Raises ``BackendError`` when the pool cannot be used (page-locking),
        ``InvalidSpecError`` for ``per_head`` where the engine's heads are not runs of a block."""
        ...


class RankMemory(Protocol):
    """One rank's memory as its remote tier is opened over it (``kvcore.plugins.Backend.open_remote``).

    ``host`` is the rank's host pool, through which every chunk the tier moves is staged, and
    ``host_address`` the address of its first byte (for a native transfer engine to register); both are
    ``None`` when the backend is configured with no host pool (``BackendSettings.MOVES_BLOCKS``), and then
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
