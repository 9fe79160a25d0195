"""Prefix lookup: the longest run of leading chunks a tier holds, without ever stalling the engine.

An embedded index answers at once; a remote one is submitted, driven to its answer by a thread of its
own (``kvcore.scheduling.lookup_pump``: the engine's pace neither slows it nor times it out) and read
when the engine asks again. Every failure, timeout or nonsensical answer is a miss (0) plus a logged
warning; a backend that keeps failing trips the circuit breaker and is not asked until its back-off is
over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from attrs import frozen

from kvcore.errors import BackendError, TransferTimeout
from kvcore.ids import ChunkKey, LookupId
from kvcore.kit.health import CircuitBreaker
from kvcore.ports import ChunkIndex, HeldChunks, SupportsHeldLookups, SupportsImmediateLookup
from kvcore.scheduling.lookup_pump import LookupPump

__all__ = ["PendingLookup", "PrefixLookup"]

log = logging.getLogger(__name__)


@frozen
class PendingLookup:
    """A remote lookup in flight: ask again until it answers, fails or its deadline passes."""

    lookup_id: LookupId
    num_chunks: int


class PrefixLookup:
    """Answers "how many leading chunks does the tier hold" for the scheduler side.

    ``timeout_s`` bounds how long a remote lookup may go unanswered; ``threaded`` (see ``LookupPump``)
    drives remote lookups from a thread of their own, else each ``resume`` polls once.
    """

    def __init__(
        self,
        index: ChunkIndex | SupportsImmediateLookup,
        timeout_s: float,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        threaded: bool = True,
    ) -> None:
        self._immediate: SupportsImmediateLookup | None = None
        self._remote: ChunkIndex | None = None
        self._pump: LookupPump | None = None
        self._lock = threading.Lock()
        if isinstance(index, SupportsImmediateLookup):
            self._immediate = index
        else:
            self._remote = index
            self._pump = LookupPump(index, timeout_s, self._lock, threaded=threaded, clock=clock)
        self._breaker = breaker if breaker is not None else CircuitBreaker(clock=clock)

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
            if self._remote is None or self._pump is None:
                if self._immediate is None:
                    return 0
                return self._accept(self._immediate.lookup(chunks), len(chunks))
            with self._lock:
                if held and isinstance(self._remote, SupportsHeldLookups):
                    lookup_id = self._remote.submit_held_lookup(chunks, preceding)
                else:
                    lookup_id = self._remote.submit_lookup(chunks, preceding)
        except BackendError as exc:
            return self._fail(f"lookup failed: {exc}")
        self._pump.watch(lookup_id)
        return PendingLookup(lookup_id, len(chunks))

    def resume(self, pending: PendingLookup) -> int | None:
        """The answer, or ``None`` to ask again on a later step; 0 for a lookup that failed or went
        unanswered past its deadline."""
        if self._pump is None:
            return 0
        outcome = self._pump.outcome(pending.lookup_id)
        if outcome is None:
            return None
        if isinstance(outcome, BackendError):
            timed_out = isinstance(outcome, TransferTimeout)
            return self._fail(str(outcome) if timed_out else f"lookup failed: {outcome}")
        return self._accept(outcome, pending.num_chunks)

    def take_held(self, pending: PendingLookup) -> HeldChunks | None:
        """The locks a held lookup that ``resume`` answered keeps (see ``SupportsHeldLookups``)."""
        if not isinstance(self._remote, SupportsHeldLookups):
            return None
        try:
            with self._lock:
                return self._remote.take_held(pending.lookup_id)
        except BackendError as exc:
            log.warning("kvcore: taking the locks of lookup %s failed: %s", pending.lookup_id, exc)
            return None

    def hand_over(self, held: HeldChunks) -> bool:
        """Hand ``held`` to the workers (true), or release it (false: see ``SupportsHeldLookups``)."""
        if not isinstance(self._remote, SupportsHeldLookups):
            return False
        try:
            with self._lock:
                return self._remote.hand_over(held)
        except BackendError as exc:
            log.warning("kvcore: handing locks over failed: %s", exc)
            return False

    def release_held(self, held: HeldChunks) -> None:
        if isinstance(self._remote, SupportsHeldLookups):
            with self._lock:
                self._remote.release_held(held)

    def abandon(self, pending: PendingLookup) -> None:
        """Forget a lookup whose answer is no longer wanted (request aborted, reset)."""
        if self._remote is not None and self._pump is not None:
            self._pump.forget(pending.lookup_id)
            try:
                with self._lock:
                    self._remote.cancel_lookup(pending.lookup_id)
            except BackendError as exc:
                log.warning("kvcore: cancelling lookup %s failed: %s", pending.lookup_id, exc)

    def close(self) -> None:
        """Stop driving remote lookups, and return once no call into the index is in progress (the
        index itself is its owner's to close)."""
        if self._pump is not None:
            self._pump.close()
        with self._lock:
            pass

    def _accept(self, answer: int, num_chunks: int) -> int:
        if not 0 <= answer <= num_chunks:
            return self._fail(f"lookup answered {answer!r} for {num_chunks} chunks")
        self._breaker.record_success()
        return answer

    def _fail(self, why: str) -> int:
        self._breaker.record_failure()
        log.warning("kvcore: %s; treating as a miss", why)
        return 0
