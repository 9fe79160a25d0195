"""Optional test hooks a harness may offer, as small runtime-checkable Protocols.

The conformance suite asks for a capability only in the tests that need it; a harness without it makes
those tests skip with a reason that names the capability. Port-level optional surfaces
(``kvcore.ports.SupportsClear``, ``SupportsImmediateLookup``) are asked of the backend itself; these
hooks are asked of the harness, which may delegate them to its backend (the in-memory references
implement them all).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from kvcore.ids import ChunkKey

__all__ = [
    "SupportsCapacity",
    "SupportsFailureInjection",
    "SupportsOutage",
    "SupportsPendingJobs",
    "SupportsPinning",
    "SupportsStall",
]


@runtime_checkable
class SupportsFailureInjection(Protocol):
    """Make the backend fail on purpose, to check what state a failure leaves."""

    def fail_next(self, count: int) -> None:
        """The next ``count`` items the backend processes fail as a tier failure would.

        An item is one block pair of a mover job, one ``StoreItem`` of a store or managed-tier job, one
        ``ByteCopy`` of a peer write, one lookup of an index (its ``poll_lookup`` raises
        ``BackendError``). Items are processed in submission order, a job's items in order.
        """
        ...


@runtime_checkable
class SupportsStall(Protocol):
    """Hold jobs in flight, to test timeouts and clears while work is pending."""

    def stall(self) -> AbstractContextManager[None]:
        """While inside, jobs (and lookups) queued or submitted do not finish; on exit they proceed."""
        ...


@runtime_checkable
class SupportsOutage(Protocol):
    """Take the backend's server away, to test that a tier that is down is an error, never an answer (an
    ``exists`` that says "absent", a lookup that says 0): the caller must be able to tell a miss from an
    outage, or no breaker opens and nobody is warned."""

    def outage(self) -> AbstractContextManager[None]:
        """While inside, the server the backend talks to does not answer (stopped or unreachable); on exit
        it answers again, holding what it held."""
        ...


@runtime_checkable
class SupportsPendingJobs(Protocol):
    """Count the backend's jobs in flight, to test that a refused submit (after ``close``) left none
    pending: a job id that was taken and then refused is never reported, and waits on it never end."""

    def pending_jobs(self) -> int:
        """Jobs the backend took and has not yet reported."""
        ...


@runtime_checkable
class SupportsCapacity(Protocol):
    """The backend was built with a bound: keys for an index, bytes of values for a store or tier."""

    @property
    def capacity(self) -> int: ...


@runtime_checkable
class SupportsPinning(Protocol):
    """Keys of an index can be pinned: a pinned key is never evicted."""

    def pin(self, keys: Sequence[ChunkKey]) -> None: ...

    def unpin(self, keys: Sequence[ChunkKey]) -> None: ...
