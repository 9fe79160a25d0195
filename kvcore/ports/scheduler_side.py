"""The scheduler side's ports: an index of the chunks a tier holds (``ChunkIndex``), answered at once by an
embedded one (``SupportsImmediateLookup``), whose lookups may keep their hits read-locked for the workers
(``SupportsHeldLookups``) and that may tell how full its tier is (``SupportsTierUsage``). The scheduler side
decides and indexes; it never touches a KV byte."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvcore.ids import ChunkKey, LookupId
from kvcore.ports.common import HeldChunks, TierUsage

__all__ = [
    "ChunkIndex",
    "SupportsHeldLookups",
    "SupportsImmediateLookup",
    "SupportsLookupProgress",
    "SupportsTierUsage",
]


class ChunkIndex(Protocol):
    """Which leading chunks a tier holds. Answers never block the engine.

    The scheduler side polls pending lookups from a thread of its own (``kvcore.scheduling.lookup_pump``)
    while submitting, cancelling and taking locks from the engine's: an index is called from two
    threads, never by both at once. A lookup of several rounds may send each round from ``poll_lookup``;
    it is polled every few milliseconds at most, whatever the engine's pace.
    """

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

        A finished answer is handed out once. Failure: raises ``BackendError`` (the caller answers 0). An
        id that is unknown, cancelled or already answered raises ``UsageError`` (the caller's mistake;
        nothing changed).
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
class SupportsLookupProgress(Protocol):
    """A ``ChunkIndex`` whose lookups take several rounds with its server, and that can tell when a lookup
    last made progress, so that the lookup's deadline counts the server's silence since then, not the time
    the rounds before took (``kvcore.scheduling.lookup_pump``)."""

    def lookup_progress(self, lookup_id: LookupId) -> float | None:
        """When (``time.monotonic()``) the server last answered a round of this lookup, or ``None`` for an
        id that is unknown, cancelled or answered."""
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
        that the chunks the answer counts stay locked for ``take_held``. For a tier that keeps a value
        per KV head (``BackendSettings.PER_HEAD``) a rank's key is its heads' keys joined
        (``kvcore.keying.keys.head_keys`` splits it): the index locks each head's value for the rank."""
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


@runtime_checkable
class SupportsTierUsage(Protocol):
    """An index that can tell how full its tier is, cheaply enough to ask every engine step."""

    def usage(self) -> TierUsage:
        """The tier's usage now. Raises ``BackendError`` when the tier cannot tell."""
        ...


# -- the remote tier a rank drives, and what it sees of the rank -----------------------------------------
