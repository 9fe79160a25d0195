"""Jobs: the results of asynchronous work and the bookkeeping shared by every backend that runs it.

Backends hand work out as jobs (``submit -> JobId``) and report completion through ``poll()`` or
``wait(ids, timeout)``; there are no callbacks, so the caller decides on which thread results are
handled.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Collection

from attrs import frozen

from kvcore.errors import TransferTimeout
from kvcore.ids import JobId

__all__ = ["JobBoard", "JobResult"]


@frozen
class JobResult:
    """How one job ended.

    ``failed`` lists the indices of the job's items that did not complete (for a get: the misses); the
    other items completed. ``error`` says why something failed; a job that failed as a whole may give it
    with no ``failed`` index (``failed_items`` then counts every item). ``ok`` is true only when every
    item completed.

    ``placed``: a publish to a stack of tiers (``kvcore.execution.cascade_remote.CascadeRemote``) tells, for
    each item, the tiers that stored it (0: the first behind the pool); empty from a single tier, where every
    item that did not fail is stored in it.
    """

    job_id: JobId
    failed: tuple[int, ...] = ()
    error: str | None = None
    placed: tuple[tuple[int, ...], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failed and self.error is None

    def failed_items(self, count: int) -> tuple[int, ...]:
        """The indices of the failed items of a job of ``count`` items: ``failed`` where it names any
        (the others completed, whatever ``error`` says of them), every item where only ``error`` says
        the job failed."""
        if self.failed or self.error is None:
            return self.failed
        return tuple(range(count))


class JobBoard:
    """Thread-safe registry of jobs in flight and of results not yet handed out.

    Workers call ``finish``; callers call ``poll`` or ``wait``. Every result is handed out exactly once,
    through whichever of the two asks first.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._pending: set[JobId] = set()
        self._done: dict[JobId, JobResult] = {}
        self._clock = clock

    def new(self) -> JobId:
        """Reserve an id for a job about to start."""
        with self._cond:
            job_id = JobId(next(self._ids))
            self._pending.add(job_id)
            return job_id

    def finish(self, result: JobResult) -> None:
        """Record a job's end and wake waiters. A result for an unknown or reported job is ignored."""
        with self._cond:
            if result.job_id not in self._pending:
                return
            self._pending.discard(result.job_id)
            self._done[result.job_id] = result
            self._cond.notify_all()

    def forget(self, job_id: JobId) -> None:
        """Drop a reserved id whose job never started (its submit was refused after ``new``): it is no
        longer pending and is never handed out. Unknown ids are ignored."""
        with self._cond:
            self._pending.discard(job_id)
            self._cond.notify_all()

    def in_flight(self) -> int:
        """Jobs reserved and not yet finished."""
        with self._cond:
            return len(self._pending)

    def poll(self) -> tuple[JobResult, ...]:
        """Every result finished since the last poll or wait, oldest id first."""
        with self._cond:
            results = tuple(self._done[k] for k in sorted(self._done))
            self._done.clear()
            return results

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        """Block until every job in ``job_ids`` finished; hand out their results in the given order.

        Ids that are neither pending nor finished (already handed out, or never issued) are skipped.
        Raises ``TransferTimeout`` after ``timeout`` seconds; the results stay for a later poll or wait.
        """
        deadline = self._clock() + timeout
        with self._cond:
            while any(j in self._pending for j in job_ids):
                left = deadline - self._clock()
                if left <= 0:
                    missing = sorted(j for j in job_ids if j in self._pending)
                    raise TransferTimeout(f"jobs {missing} not finished after {timeout:.3f}s")
                self._cond.wait(left)
            return tuple(self._done.pop(j) for j in job_ids if j in self._done)
