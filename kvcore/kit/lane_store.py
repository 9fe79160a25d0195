"""``LaneStore``: what every ``ChunkStore`` that runs its jobs on one ``JobLane`` over one host buffer
shares (the Mooncake store, the disk tier), so that they check, queue, clear and close alike.

- **Checked first.** Every item must name non-empty ranges of the host buffer (``check_ranges``); otherwise
  ``InvalidSpecError`` names the item, and nothing is queued.
- **Queued on a lane.** Gets are reads and run before queued puts (``kvcore.kit.lane``); a job of no items
  finishes at once. A store whose writes may wait on something its reads must never wait on (the disk
  tier's lock, which another process may hold) runs its reads on a lane of their own
  (``separate_reads``): a get never queues behind a put.
- **Cleared jobs fail.** ``_clear_queued`` (a subclass's ``clear``, holding ``_io``) dooms every job
  queued before it: such a job fails without running, so no put in flight resurrects a cleared value. A
  job runs with its lane's lock held (``_io`` for writes, and for reads unless they have a lane of
  their own), and ``_io`` holds every lane's lock, so a ``clear`` waits for the jobs running.
- **Closed.** ``close`` refuses new jobs (``UsageError``), fails the queued ones, and joins the lanes for
  a bounded time; every job submitted still gets a result through ``poll``/``wait``.

A subclass implements ``_run(job)`` (on a lane thread, its lane's lock held, the job not cleared) and
``_closed_lane`` (what it releases after its lanes). ``_background`` queues work of its own behind the
puts, with no result.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from functools import partial

from attrs import frozen

from kvcore.errors import UsageError
from kvcore.ids import JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.kit.host_ranges import check_ranges
from kvcore.kit.lane import JobLane, LaneClosed, Priority
from kvcore.ports import StoreItem

__all__ = ["LaneStore", "StoreJob"]

log = logging.getLogger(__name__)


@frozen(eq=False)
class StoreJob:
    """One put or get job: its items, in order, and the clear generation it was queued in."""

    job_id: JobId
    put: bool
    items: tuple[StoreItem, ...]
    generation: int

    def failed(self, why: str) -> JobResult:
        """The job's result with every item failed."""
        return JobResult(self.job_id, tuple(range(len(self.items))), why)


class LaneStore(ABC):
    """The job half of a ``ChunkStore`` (module docstring): ``submit_put``, ``submit_get``, ``poll``,
    ``wait``, ``close``. ``name`` names the store in errors and its lanes' threads; ``buffer_length`` is
    the host buffer's size in bytes; ``separate_reads`` gives gets a lane of their own."""

    def __init__(self, name: str, buffer_length: int, *, separate_reads: bool = False) -> None:
        self._name = name
        self._buffer_length = buffer_length
        self._board = JobBoard()
        self._state = threading.Lock()  # closed flag, generation
        self._closed = False
        self._generation = 0
        thread = f"kvcore-{name.replace(' ', '-')}"
        self._lane = JobLane(thread)
        self._read_lane = JobLane(f"{thread}-reads") if separate_reads else self._lane
        write_lock = threading.Lock()
        read_lock = threading.Lock() if separate_reads else write_lock
        self._locks = {True: write_lock, False: read_lock}  # by job kind (put): held around its job
        self._io = _Both(write_lock, read_lock) if separate_reads else write_lock

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        return self._submit(True, items)

    def submit_get(self, items: Sequence[StoreItem]) -> JobId:
        return self._submit(False, items)

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def pending_jobs(self) -> int:
        """Jobs taken and not yet reported (a conformance harness's ``SupportsPendingJobs``)."""
        return self._board.in_flight()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking jobs, fail those not started, join the lane (bounded by ``timeout``); then
        ``_closed_lane``. Idempotent; every submitted job still gets a result."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        why = f"the {self._name} closed before the job ran"
        deadline = time.monotonic() + timeout
        for lane in dict.fromkeys((self._read_lane, self._lane)):
            lane.close(max(0.0, deadline - time.monotonic()), why=why)
        self._closed_lane(timeout)

    @abstractmethod
    def _closed_lane(self, timeout: float) -> None:
        """Release what the store holds beside its lane (a client, threads), once the lane is closed."""

    def _clear_queued(self) -> None:
        """Doom every job queued so far (call with ``_io`` held, from ``clear``)."""
        with self._state:
            self._generation += 1

    @abstractmethod
    def _run(self, job: StoreJob) -> JobResult:
        """Run ``job`` (on the lane thread, with ``_io`` held); its result."""

    def _submit(self, put: bool, items: Sequence[StoreItem]) -> JobId:
        for i, item in enumerate(items):
            check_ranges(i, item, self._buffer_length)
        with self._state:
            if self._closed:
                raise UsageError(f"the {self._name} is closed")
            job = StoreJob(self._board.new(), put, tuple(items), self._generation)
            if items:  # under the lock that close takes first: the lanes are open, unless their thread died
                lane, priority = (self._lane, Priority.WRITE) if put else (self._read_lane, Priority.READ)
                try:
                    lane.submit(partial(self._finish, job), partial(self._fail, job), priority)
                except LaneClosed:
                    self._board.forget(job.job_id)  # refused: no id stays pending
                    raise
        if not items:
            self._board.finish(JobResult(job.job_id))
        return job.job_id

    def _background(self, run: Callable[[], object], what: str) -> None:
        """Queue ``run`` on the write lane, behind the puts queued so far (a cleared store runs it too);
        a failure, or a store already closed, is logged naming ``what``."""

        def failed(why: str) -> None:
            log.warning("kvcore: %s: %s", what, why)

        try:
            self._lane.submit(run, failed, Priority.WRITE)
        except LaneClosed as exc:
            failed(str(exc))

    def _finish(self, job: StoreJob) -> None:
        with self._locks[job.put]:
            with self._state:
                cleared = job.generation != self._generation
            result = (
                job.failed("the store was cleared while the job was queued") if cleared else self._run(job)
            )
        self._board.finish(result)

    def _fail(self, job: StoreJob, why: str) -> None:
        self._board.finish(job.failed(why))


class _Both:
    """Two locks as one (``with``): taken in a fixed order, released in the other."""

    def __init__(self, first: threading.Lock, second: threading.Lock) -> None:
        self._first, self._second = first, second

    def __enter__(self) -> None:
        self._first.acquire()
        self._second.acquire()

    def __exit__(self, *exc: object) -> None:
        self._second.release()
        self._first.release()
