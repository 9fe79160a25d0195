"""The remote tiers a backend implements for the worker side: a content-addressed store the client fills
and drains (``ChunkStore``), or a tier that manages its own memory and sessions (``ManagedTier``), which
may also move engine blocks itself (``SupportsBlockTransfer``) and take over a lookup's read locks
(``SupportsAdoptedLocks``). ``kvcore.plugins.compose`` makes either the worker's ``RemoteTier``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.ports.common import BlockItem, JobQueue, StoreItem

__all__ = ["ChunkStore", "ManagedTier", "SupportsAdoptedLocks", "SupportsBlockTransfer"]


@runtime_checkable
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


@runtime_checkable
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
