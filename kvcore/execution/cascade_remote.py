"""The remote tier of a stack of tiers behind the pool (``CascadeRemote``): the worker side of
``kvcore.config.tiers``'s ``TierStack``; the scheduler side is ``kvcore.scheduling.cascade_index``.

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
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from functools import partial

from attrs import frozen

from kvcore.errors import KVCoreError, TransferTimeout, UsageError
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.kit.closing import close_quietly
from kvcore.kit.lane import JobLane, Priority
from kvcore.ports import RemoteTier, StoreItem

__all__ = ["CascadeRemote"]

log = logging.getLogger(__name__)

_POLL_S = 1.0
"""How long one wait on a tier's job lasts; the cascade waits again until the job ends."""
_CLOSE_S = 5.0
"""How long ``close`` waits for a job that is running (on a tier that answers, a publish in progress)."""
_SEEN = 1 << 16
"""Keys whose saves a rank remembers for admission, least recently saved forgotten first: a chunk saved
again after 65,536 other chunks counts as saved once."""


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
    is written back (default: none is)."""

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
        return failed

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
