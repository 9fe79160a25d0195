"""Prefix lookup: the longest run of leading chunks a tier holds, without ever stalling the engine.

An embedded index answers at once; a remote one is submitted and polled ("ask again") until it answers
or its deadline passes. Every failure, timeout or nonsensical answer is a miss (0) plus a logged warning;
a backend that keeps failing trips the circuit breaker and is not asked until its back-off is over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from attrs import frozen

from kvcore.errors import BackendError
from kvcore.ids import ChunkKey, LookupId
from kvcore.kit.health import CircuitBreaker
from kvcore.ports import ChunkIndex, HeldChunks, SupportsHeldLookups, SupportsImmediateLookup

__all__ = ["PendingLookup", "PrefixLookup"]

log = logging.getLogger(__name__)


@frozen
class PendingLookup:
    """A remote lookup in flight: ask again until it answers or ``deadline`` (monotonic) passes."""

    lookup_id: LookupId
    deadline: float
    num_chunks: int


class PrefixLookup:
    """Answers "how many leading chunks does the tier hold" for the scheduler side."""

    def __init__(
        self,
        index: ChunkIndex | SupportsImmediateLookup,
        timeout_s: float,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._immediate: SupportsImmediateLookup | None = None
        self._remote: ChunkIndex | None = None
        if isinstance(index, SupportsImmediateLookup):
            self._immediate = index
        else:
            self._remote = index
        self._timeout = timeout_s
        self._breaker = breaker if breaker is not None else CircuitBreaker(clock=clock)
        self._clock = clock

    @property
    def holds(self) -> bool:
        """Whether lookups can keep their hits locked for the workers (``SupportsHeldLookups``)."""
        return isinstance(self._remote, SupportsHeldLookups)

    def begin(
        self,
        chunks: Sequence[Sequence[ChunkKey]],
        preceding: Sequence[Sequence[ChunkKey]] = (),
        *,
        held: bool = False,
    ) -> int | PendingLookup:
        """Start a lookup: the answer at once, or a pending lookup to ``resume`` on a later step.

        ``preceding`` are the request's chunks before ``chunks`` (see ``ChunkIndex.submit_lookup``); an
        immediate index keys chunks alone and is not given them. ``held`` (where ``holds``): a held
        lookup, each chunk naming every rank's key (``SupportsHeldLookups.submit_held_lookup``); the
        caller takes its locks with ``take_held`` once it answered."""
        if not chunks or not self._breaker.allow():
            return 0
        try:
            if self._remote is None:
                return (
                    self._accept(self._immediate.lookup(chunks), len(chunks))
                    if self._immediate is not None
                    else 0
                )
            if held and isinstance(self._remote, SupportsHeldLookups):
                lookup_id = self._remote.submit_held_lookup(chunks, preceding)
            else:
                lookup_id = self._remote.submit_lookup(chunks, preceding)
        except BackendError as exc:
            return self._fail(f"lookup failed: {exc}")
        return PendingLookup(lookup_id, self._clock() + self._timeout, len(chunks))

    def resume(self, pending: PendingLookup) -> int | None:
        """The answer, or ``None`` to ask again on a later step; 0 once the deadline has passed."""
        if self._remote is None:
            return 0
        try:
            answer = self._remote.poll_lookup(pending.lookup_id)
        except BackendError as exc:
            return self._fail(f"lookup failed: {exc}")
        if answer is not None:
            return self._accept(answer, pending.num_chunks)
        if self._clock() < pending.deadline:
            return None
        self.abandon(pending)
        return self._fail(f"lookup timed out after {self._timeout:.3f}s")

    def take_held(self, pending: PendingLookup) -> HeldChunks | None:
        """The locks a held lookup that ``resume`` answered keeps (see ``SupportsHeldLookups``)."""
        if not isinstance(self._remote, SupportsHeldLookups):
            return None
        try:
            return self._remote.take_held(pending.lookup_id)
        except BackendError as exc:
            log.warning("kvcore: taking the locks of lookup %s failed: %s", pending.lookup_id, exc)
            return None

    def hand_over(self, held: HeldChunks) -> bool:
        """Hand ``held`` to the workers (true), or release it (false: see ``SupportsHeldLookups``)."""
        if not isinstance(self._remote, SupportsHeldLookups):
            return False
        try:
            return self._remote.hand_over(held)
        except BackendError as exc:
            log.warning("kvcore: handing locks over failed: %s", exc)
            return False

    def release_held(self, held: HeldChunks) -> None:
        if isinstance(self._remote, SupportsHeldLookups):
            self._remote.release_held(held)

    def abandon(self, pending: PendingLookup) -> None:
        """Forget a lookup whose answer is no longer wanted (request aborted, timed out)."""
        if self._remote is not None:
            try:
                self._remote.cancel_lookup(pending.lookup_id)
            except BackendError as exc:
                log.warning("kvcore: cancelling lookup %s failed: %s", pending.lookup_id, exc)

    def _accept(self, answer: int, num_chunks: int) -> int:
        if not 0 <= answer <= num_chunks:
            return self._fail(f"lookup answered {answer!r} for {num_chunks} chunks")
        self._breaker.record_success()
        return answer

    def _fail(self, why: str) -> int:
        self._breaker.record_failure()
        log.warning("kvcore: %s; treating as a miss", why)
        return 0
