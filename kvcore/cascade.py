"""Remote tiers that cascade behind the pool: ``CascadeIndex`` (scheduler side) and ``CascadeRemote``
(worker side), over the indexes and remote tiers of a ``TierStack``'s tiers, in order.

- **Lookup.** Each tier is asked for the chunks the tiers before it lack: the first for every chunk after
  the pool's leading run, the next for the chunks after the first's leading run, and so on; the answer
  is the sum. A tier whose lookup fails answers 0 and the next tier is asked for the same chunks, so a
  tier that is down hides none of the others' chunks; a tier still pending when the lookup's budget is
  spent is cancelled and the lookup answers what the tiers before it found (``CascadeIndex``).
- **Fetch.** Each rank asks the tiers in order for the chunks it must fetch: the first for all of them,
  the next for those the first failed to deliver. It does not need to know which tier the scheduler's
  lookup found a chunk in (a miss on a local disk costs one ``open``), and a chunk evicted from one tier
  since the lookup is still found in the next. A fetched chunk lands in its pool slot, which the pool
  then publishes: promoted into the CPU tier on its way to the engine.
- **Publish (write-through).** A save goes to every tier that admits it, side by side; it fails only if
  every tier it was sent to failed it (a tier that is down does not cost the others their copy). A chunk
  no tier admits yet (``Tier.admit_after``: the saves this rank must see first) is not sent anywhere and
  is not a failure: the pool keeps it.
- **Write-back.** A tier written back (``Tier.write``) takes no save: it takes a chunk when the pool is
  about to evict it (``submit_write_back``, by the same admission rule, the saves already counted), so a
  stack with such a tier is a ``CascadeRemote`` even when it is the only remote tier.

Jobs run on two ``JobLane`` threads, fetches apart from publishes, so a save never holds up a load. A job
waits for each tier's job without a time bound: the tier's own transfers are bounded and every job of a
port ends (a tier job that is still copying into a host slot must end before the slot is given back).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import cast

from attrs import define, frozen

from kvcore.errors import BackendError, KVCoreError, TransferTimeout, UsageError
from kvcore.health import CircuitBreaker
from kvcore.ids import ChunkKey, JobId, LookupId
from kvcore.jobs import JobBoard, JobResult
from kvcore.lane import JobLane, Priority
from kvcore.ports import (
    ChunkIndex,
    RemoteTier,
    StoreItem,
    SupportsImmediateLookup,
    SupportsTierUsage,
    TierUsage,
)
from kvcore.remote import close_quietly

__all__ = [
    "CascadeIndex",
    "CascadeRemote",
    "ImmediateCascadeIndex",
    "TierCounts",
    "cascade_index",
    "tier_usage",
]

log = logging.getLogger(__name__)

_POLL_S = 1.0
"""How long one wait on a tier's job lasts; the cascade waits again until the job ends."""
_CLOSE_S = 5.0
"""How long ``close`` waits for a job that is running (on a tier that answers, a publish in progress)."""
_SEEN = 1 << 16
"""Keys whose saves a rank remembers for admission, least recently saved forgotten first: a chunk saved
again after 65,536 other chunks counts as saved once."""


@define
class TierCounts:
    """What one tier did since start: chunks found by lookups (scheduler side), chunks and bytes fetched
    and published, and items it failed (worker side)."""

    found: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    published: int = 0
    published_bytes: int = 0
    failed: int = 0


def tier_usage(index: ChunkIndex) -> TierUsage | None:
    """How full ``index``'s tier is, if it can tell (``SupportsTierUsage``); ``None`` if not, or if it
    fails to (logged: a metric is never worth an engine's step)."""
    if not isinstance(index, SupportsTierUsage):
        return None
    try:
        return index.usage()
    except (KVCoreError, OSError) as exc:
        log.warning("kvcore: %s could not tell its usage: %s", type(index).__name__, exc)
        return None


@define(eq=False)
class _Lookup:
    chunks: list[Sequence[ChunkKey]]
    preceding: list[Sequence[ChunkKey]]
    deadline: float
    stage: int = 0
    found: int = 0
    inner: LookupId | None = None


class CascadeIndex:
    """The ``ChunkIndex`` of several tiers asked in order (module docstring). ``counts[i]`` tells what
    tier ``i`` found.

    ``budget_s`` bounds a whole lookup: a tier still pending past it is cancelled and the lookup answers
    what the tiers before it found (the caller's own timeout, ``lookup_timeout_s``, would answer 0 for
    all of them). A tier that fails ``BREAKER_FAILURES`` lookups in a row is skipped for a back-off
    (``kvcore.health.CircuitBreaker``), so a tier that is down costs the others nothing per lookup.
    """

    BREAKER_FAILURES = 3
    BREAKER_BACKOFF_S = 5.0

    def __init__(
        self, indexes: Sequence[ChunkIndex], budget_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if len(indexes) < 2:
            raise UsageError(f"indexes: got {len(indexes)}, expected at least two tiers to cascade")
        self._indexes = tuple(indexes)
        self._budget = budget_s
        self._clock = clock
        self._breakers = [
            CircuitBreaker(self.BREAKER_FAILURES, self.BREAKER_BACKOFF_S, clock) for _ in indexes
        ]
        self._ids = itertools.count(1)
        self._lookups: dict[LookupId, _Lookup] = {}
        self.counts = [TierCounts() for _ in indexes]

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        lookup = _Lookup(list(chunks), list(preceding), self._clock() + self._budget)
        lookup_id = LookupId(next(self._ids))
        self._lookups[lookup_id] = lookup
        self._ask(lookup)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        lookup = self._lookups.get(lookup_id)
        if lookup is None:
            return 0
        while lookup.inner is not None:
            index, breaker = self._indexes[lookup.stage], self._breakers[lookup.stage]
            try:
                answer = index.poll_lookup(lookup.inner)
            except BackendError as exc:
                log.warning(
                    "kvcore: tier %d's lookup failed (%s): asking the next tier", lookup.stage + 1, exc
                )
                breaker.record_failure()
                answer = 0
            else:
                if answer is None:
                    if self._clock() < lookup.deadline:
                        return None
                    index.cancel_lookup(lookup.inner)  # too late: answer what the tiers before it found
                    log.warning(
                        "kvcore: tier %d's lookup took too long: answered without it", lookup.stage + 1
                    )
                    breaker.record_failure()
                    break
                breaker.record_success()
            answer = max(0, min(int(answer), len(lookup.chunks) - lookup.found))
            self.counts[lookup.stage].found += answer
            lookup.found += answer
            lookup.stage += 1
            self._ask(lookup)
        del self._lookups[lookup_id]
        return lookup.found

    def usage(self) -> tuple[TierUsage | None, ...]:
        """Each tier's usage (``tier_usage``), in order."""
        return tuple(tier_usage(index) for index in self._indexes)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        lookup = self._lookups.pop(lookup_id, None)
        if lookup is not None and lookup.inner is not None:
            self._indexes[lookup.stage].cancel_lookup(lookup.inner)

    def close(self) -> None:
        """Close every tier's index; pending lookups are dropped."""
        self._lookups.clear()
        for index in self._indexes:
            close_quietly(index)

    def _ask(self, lookup: _Lookup) -> None:
        """Submit the lookup's chunks not found yet to its current tier, or end it (``inner`` None) once
        every chunk is found or every tier asked. A tier that refuses, or whose breaker is open, is
        skipped."""
        lookup.inner = None
        while lookup.stage < len(self._indexes) and lookup.found < len(lookup.chunks):
            rest = lookup.chunks[lookup.found :]
            before = lookup.preceding + lookup.chunks[: lookup.found]
            breaker = self._breakers[lookup.stage]
            if breaker.allow():
                try:
                    lookup.inner = self._indexes[lookup.stage].submit_lookup(rest, before)
                    return
                except BackendError as exc:
                    log.warning("kvcore: tier %d refused a lookup (%s)", lookup.stage + 1, exc)
                    breaker.record_failure()
            lookup.stage += 1


class ImmediateCascadeIndex(CascadeIndex):
    """A ``CascadeIndex`` whose tiers all answer at once (``SupportsImmediateLookup``: local disks), so
    that it does too and a lookup costs the engine no step."""

    def __init__(
        self,
        indexes: Sequence[SupportsImmediateLookup],
        budget_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cast(Sequence[ChunkIndex], indexes), budget_s, clock)
        self._immediate = tuple(indexes)

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        found = 0
        for tier, (index, breaker) in enumerate(zip(self._immediate, self._breakers, strict=True)):
            if found == len(chunks):
                break
            if not breaker.allow():
                continue
            try:
                answer = index.lookup(chunks[found:])
            except BackendError as exc:
                log.warning("kvcore: tier %d's lookup failed (%s): asking the next tier", tier + 1, exc)
                breaker.record_failure()
                continue
            breaker.record_success()
            answer = max(0, min(int(answer), len(chunks) - found))
            self.counts[tier].found += answer
            found += answer
        return found


def cascade_index(indexes: Sequence[ChunkIndex], budget_s: float) -> CascadeIndex:
    """The cascade of ``indexes``: immediate when every one of them is."""
    immediate = [index for index in indexes if isinstance(index, SupportsImmediateLookup)]
    if len(immediate) == len(indexes):
        return ImmediateCascadeIndex(immediate, budget_s)
    return CascadeIndex(indexes, budget_s)


@frozen(eq=False)
class _Job:
    job_id: JobId
    session: str
    items: tuple[StoreItem, ...]
    chain: tuple[ChunkKey, ...]
    tiers: tuple[tuple[int, ...], ...]  # publish: the tiers each item goes to; fetch: unused


class CascadeRemote:
    """The ``RemoteTier`` of a stack's remote tiers: fetches try them in order, publishes go to every
    tier written through that admits the chunk, write-backs to every tier written back that admits it
    (module docstring). ``admit_after[i]`` is tier ``i``'s admission rule, ``write_back[i]`` whether it
    is written back (default: none is); ``counts[i]`` what tier ``i`` moved."""

    def __init__(
        self,
        tiers: Sequence[RemoteTier],
        admit_after: Sequence[int],
        write_back: Sequence[bool] | None = None,
    ) -> None:
        back = tuple(write_back) if write_back is not None else (False,) * len(tiers)
        if not tiers or len(admit_after) != len(tiers) or len(back) != len(tiers):
            raise UsageError(
                f"tiers: got {len(tiers)} with {len(admit_after)} admission rules and {len(back)} write "
                "modes, expected at least one tier and one rule and mode each"
            )
        self._tiers = tuple(tiers)
        self._admit = tuple(admit_after)
        self._back = back
        self._board = JobBoard()
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict[ChunkKey, int] = collections.OrderedDict()
        self._closed = False
        self._fetches = JobLane("kvcore-cascade-fetch")
        self._publishes = JobLane("kvcore-cascade-publish")
        self.counts = [TierCounts() for _ in tiers]  # changed under ``_lock``

    # -- RemoteTier ----------------------------------------------------------------------------------

    def submit_fetch(self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()) -> JobId:
        return self._submit(self._fetches, self._fetch, session, items, chain, ())

    def submit_publish(
        self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        with self._lock:
            tiers = tuple(self._admitted(item.key, count=True, back=False) for item in items)
        return self._submit(self._publishes, self._publish, session, items, chain, tiers)

    @property
    def writes_back(self) -> bool:
        return any(self._back)

    def submit_write_back(self, session: str, items: Sequence[StoreItem]) -> JobId:
        with self._lock:
            tiers = tuple(self._admitted(item.key, count=False, back=True) for item in items)
        return self._submit(self._publishes, self._publish, session, items, (), tiers)

    def adopt(self, session: str, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        for tier in self._tiers:
            tier.adopt(session, holder, chain, start, end)

    def end_session(self, session: str) -> None:
        for tier in self._tiers:
            tier.end_session(session)

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def close(self) -> None:
        """Refuse new jobs, fail the queued ones, wait (bounded) for the running ones, then close every
        tier (their jobs in flight still end, and so do cascade jobs still waiting on them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for lane in (self._fetches, self._publishes):
            lane.close(_CLOSE_S, why="the cascade closed before the job ran")
        for tier in self._tiers:
            close_quietly(tier)

    # -- jobs ----------------------------------------------------------------------------------------

    def _submit(
        self,
        lane: JobLane,
        run: Callable[[_Job], JobResult],
        session: str,
        items: Sequence[StoreItem],
        chain: Sequence[ChunkKey],
        tiers: tuple[tuple[int, ...], ...],
    ) -> JobId:
        with self._lock:
            if self._closed:
                raise UsageError("the cascade of remote tiers is closed")
            job = _Job(self._board.new(), session, tuple(items), tuple(chain), tiers)
            lane.submit(partial(self._finish, run, job), partial(self._fail, job), Priority.READ)
        return job.job_id

    def _finish(self, run: Callable[[_Job], JobResult], job: _Job) -> None:
        self._board.finish(run(job))

    def _fail(self, job: _Job, why: str) -> None:
        self._board.finish(JobResult(job.job_id, tuple(range(len(job.items))), why))

    def _fetch(self, job: _Job) -> JobResult:
        pending = list(range(len(job.items)))
        for t, tier in enumerate(self._tiers):
            if not pending:
                break
            items = [job.items[i] for i in pending]
            failed = self._await(t, self._submit_to(t, tier.submit_fetch, job, items), len(items))
            got = [pending[j] for j in range(len(items)) if j not in failed]
            self._count(t, fetched=len(got), fetched_bytes=sum(job.items[i].length for i in got))
            pending = [pending[j] for j in sorted(failed)]
        return JobResult(job.job_id, tuple(pending))  # misses, not an error: the others were fetched

    def _publish(self, job: _Job) -> JobResult:
        sent = [i for i, tiers in enumerate(job.tiers) if tiers]
        parts = []  # (tier, its items' indices in the job, its job or None if it refused them)
        for t, tier in enumerate(self._tiers):  # every tier's part submitted first: they run side by side
            mine = [i for i in sent if t in job.tiers[i]]
            if mine:
                parts.append(
                    (t, mine, self._submit_to(t, tier.submit_publish, job, [job.items[i] for i in mine]))
                )
        placed: list[list[int]] = [[] for _ in job.items]
        for t, mine, inner in parts:
            failed = self._await(t, inner, len(mine))
            done = [mine[j] for j in range(len(mine)) if j not in failed]
            for i in done:
                placed[i].append(t)
            self._count(t, published=len(done), published_bytes=sum(job.items[i].length for i in done))
        lost = tuple(i for i in sent if not placed[i])  # failed items, not an error: the others are stored
        return JobResult(job.job_id, lost, placed=tuple(tuple(tiers) for tiers in placed))

    def _submit_to(
        self,
        t: int,
        submit: Callable[[str, Sequence[StoreItem], Sequence[ChunkKey]], JobId],
        job: _Job,
        items: list[StoreItem],
    ) -> JobId | None:
        """Hand one tier its part of a job; ``None`` if it refused (closed, down): every item failed."""
        try:
            return submit(job.session, items, job.chain)
        except KVCoreError as exc:
            log.warning("kvcore: tier %d refused %d chunks: %s", t + 1, len(items), exc)
            return None

    def _await(self, t: int, inner: JobId | None, size: int) -> set[int]:
        """Wait for tier ``t``'s job ``inner`` (of ``size`` items) to end; the indices it failed
        (``JobResult.failed_items``, as the worker reads a remote job's result)."""
        failed = set(range(size))
        if inner is not None:
            while True:
                try:
                    results = self._tiers[t].wait([inner], _POLL_S)
                    break
                except TransferTimeout:  # not finished yet: every job of a port ends, and a copy into
                    continue  # the host slot must end before the slot can be given back
            if results:
                failed = set(results[0].failed_items(size))
        self._count(t, failed=len(failed))
        return failed

    def _count(self, t: int, **moved: int) -> None:
        with self._lock:
            counts = self.counts[t]
            for name, value in moved.items():
                setattr(counts, name, getattr(counts, name) + value)

    def _admitted(self, key: ChunkKey, *, count: bool, back: bool) -> tuple[int, ...]:
        """The tiers written back (``back``) or through whose admission rule ``key`` passes, after
        counting one more save of it if ``count`` (with ``_lock``). A rule of 1 admits every chunk,
        remembered or not."""
        if count:
            seen = self._seen.pop(key, 0) + 1
            self._seen[key] = seen
            if len(self._seen) > _SEEN:
                self._seen.popitem(last=False)
        else:
            seen = self._seen.get(key, 0)
        return tuple(
            t
            for t, (after, written_back) in enumerate(zip(self._admit, self._back, strict=True))
            if written_back is back and (after <= 1 or seen >= after)
        )
