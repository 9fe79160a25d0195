"""``MooncakeChunkIndex``: the ``ChunkIndex`` port for the scheduler, on a pure Mooncake client.

The scheduler holds no KV, so its client contributes no segment (``global_segment_size=0``); it only asks
the master which keys exist (``batch_is_exist``, about 150-450 us for 256 keys on loopback). Lookups run
in order on a ``JobLane`` so that the engine's step never waits on the network: ``submit_lookup`` returns at
once, ``poll_lookup`` answers ``None`` while the lookup is pending. A lookup not answered within
``timeout_s`` is a failure (the caller answers 0), and so is every master error; repeated failures open a
circuit breaker, and while it is open ``submit_lookup`` refuses at once, so a dead master (whose calls
hang about 4 s each) costs the scheduler nothing per step.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from attrs import define

from kvcore.errors import BackendError, BackendUnavailable, TransferTimeout, UsageError
from kvcore.ids import ChunkKey, LookupId
from kvcore.kit.faults import FaultHooks
from kvcore.kit.health import CircuitBreaker
from kvcore.kit.lane import JobLane, Priority
from kvcore.kit.leading import by_chunk, leading_chunks
from kvcore_mooncake.client import MooncakeClient, describe
from kvcore_mooncake.config import MooncakeStoreConfig

__all__ = ["MooncakeChunkIndex"]


@define(eq=False)
class _Lookup:
    keys: list[str]
    sizes: tuple[int, ...]  # shards per chunk, in order
    deadline: float
    answer: int | None = None
    error: str | None = None


class MooncakeChunkIndex:
    """Which leading chunks the Mooncake pool holds, every shard of each.

    Build it from a set-up client, or with ``open`` (a pure client it owns). ``timeout_s`` bounds each
    lookup; ``breaker`` (default: open after 3 failures for 2 s) guards the master. ``faults``
    (``kvcore.kit.faults``) run on the lookup thread before each lookup asks the master.
    """

    def __init__(
        self,
        client: MooncakeClient,
        timeout_s: float,
        *,
        owns_client: bool = False,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
        faults: FaultHooks | None = None,
    ) -> None:
        self._client = client
        self._owns_client = owns_client
        self._timeout = timeout_s
        self._clock = clock
        self._breaker = breaker if breaker is not None else CircuitBreaker(threshold=3, backoff_s=2.0)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._lookups: dict[LookupId, _Lookup] = {}
        self._closed = False
        self._faults = faults
        self._lane = JobLane("kvcore-mooncake-index")

    @classmethod
    def open(cls, config: MooncakeStoreConfig, timeout_s: float) -> MooncakeChunkIndex:
        """Set up a pure client (no segment) for ``config.master``; raises ``BackendUnavailable``."""
        return cls(MooncakeClient.connect(config, segment_size=0), timeout_s, owns_client=True)

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        """Queue a lookup and return at once. Raises ``BackendUnavailable`` while the master is marked
        unhealthy or after ``close``. Mooncake keys each chunk alone, so ``preceding`` is ignored."""
        keys: list[str] = [key for chunk in chunks for key in chunk]
        lookup = _Lookup(keys, tuple(len(chunk) for chunk in chunks), self._clock() + self._timeout)
        if not keys:
            lookup.answer = 0
        elif not self._breaker.allow():
            raise BackendUnavailable(f"Mooncake master {self._client.master} is marked unhealthy")
        with self._lock:
            if self._closed:
                raise BackendUnavailable("the Mooncake index is closed")
            lookup_id = LookupId(next(self._ids))
            self._lookups[lookup_id] = lookup
            if keys:  # under the lock that close takes first: the lane is still open
                self._lane.submit(partial(self._answer, lookup), partial(self._fail, lookup), Priority.READ)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        """The answer (once), or ``None`` while pending. Raises ``BackendError`` when the master failed
        or answered nonsense, ``TransferTimeout`` once ``timeout_s`` passed without an answer,
        ``BackendUnavailable`` once closed (its pending lookups dropped), ``UsageError`` for an id that
        is unknown, cancelled or already answered."""
        with self._lock:
            if self._closed:
                raise BackendUnavailable(f"the Mooncake index is closed: lookup {lookup_id} was dropped")
            lookup = self._lookups.get(lookup_id)
            if lookup is None:
                raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
            done = lookup.answer is not None or lookup.error is not None
            expired = not done and self._clock() >= lookup.deadline
            if done or expired:
                del self._lookups[lookup_id]
        if lookup.error is not None:
            raise BackendError(lookup.error)
        if expired:
            raise TransferTimeout(f"lookup {lookup_id} not answered within {self._timeout:.3f}s")
        return lookup.answer

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        with self._lock:
            self._lookups.pop(lookup_id, None)

    def close(self, timeout: float = 5.0) -> None:
        """Refuse new lookups, stop the worker (bounded), close an owned client. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lookups.clear()
        self._lane.close(timeout, why="the index closed before the lookup ran")
        if self._owns_client:
            self._client.close(timeout)

    def _answer(self, lookup: _Lookup) -> None:
        """On the lane: ask the master which keys exist (after the fault hooks), and record the answer.

        A lookup cancelled while queued still runs, so that every lookup the breaker let through (a
        probe, perhaps) reports its outcome; one that expired while queued counts as a failure.
        """
        if self._clock() >= lookup.deadline:
            self._breaker.record_failure()
            return
        try:
            if self._faults is not None:
                self._faults.before_lookup(len(lookup.keys))
            codes = self._client.exist(lookup.keys)
        # Any failure of the call is this lookup's failure, handed to its poll, never raised here.
        except Exception as exc:
            answer: int | None = None
            error: str | None = f"lookup failed: {type(exc).__name__}: {exc}"
        else:
            answer = _leading(codes, lookup)
            error = None if answer is not None else f"batch_is_exist answered {_bad(codes)}"
        if answer is None:
            self._breaker.record_failure()
        else:
            self._breaker.record_success()
        with self._lock:
            lookup.answer, lookup.error = answer, error

    def _fail(self, lookup: _Lookup, why: str) -> None:
        with self._lock:
            lookup.error = why


def _leading(codes: list[int], lookup: _Lookup) -> int | None:
    """Leading chunks with every shard present; ``None`` when the answer is not 0/1 per key."""
    if len(codes) != len(lookup.keys) or any(c not in (0, 1) for c in codes):
        return None
    return leading_chunks(by_chunk(codes, lookup.sizes), all)


def _bad(codes: list[int]) -> str:
    wrong = sorted({c for c in codes if c not in (0, 1)})
    return ", ".join(describe(c) for c in wrong) or f"{len(codes)} codes"
