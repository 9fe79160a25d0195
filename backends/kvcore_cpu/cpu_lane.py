"""The CPU engine's copy lane: block copies on a ``JobLane``, so that saves never block the engine's thread.

Loads are reads and saves writes (``kvcore.kit.lane``): a queued load goes before queued saves (a request is
waiting on a load; a save only has to finish before its slot is used), and jobs of one direction run in
submission order. The port promises no order between a load and a save. Fault hooks, if given, run on
the lane before each copy (``kvcore.kit.faults``).
"""

from __future__ import annotations

import threading
from functools import partial

from attrs import frozen

from kvcore.errors import TransferTimeout
from kvcore.ids import JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.kit.faults import FaultHooks, leading_failures
from kvcore.kit.lane import JobLane, LaneClosed, Priority
from kvcore.ports import Direction
from kvcore_cpu.cpu_copy import BlockCopier
from kvcore_cpu.rows import IntArray

__all__ = ["CpuLane"]

_PRIORITY = {Direction.LOAD: Priority.READ, Direction.SAVE: Priority.WRITE}


@frozen(eq=False)
class _Job:
    job_id: JobId
    direction: Direction
    engine_ids: IntArray
    host_ids: IntArray
    which: int


class CpuLane:
    """Runs copies with ``copier`` on a ``JobLane`` and reports them to ``board``.

    ``start`` after ``close`` raises ``LaneClosed`` (a ``UsageError``) instead of queueing a job that no
    thread would run.
    """

    def __init__(self, board: JobBoard, copier: BlockCopier, faults: FaultHooks | None = None) -> None:
        self._board = board
        self._copier = copier
        self._faults = faults
        self._lane = JobLane("kvcore-mover")
        self._loads: dict[JobId, threading.Event] = {}

    def start(
        self,
        job_id: JobId,
        direction: Direction,
        engine_ids: IntArray,
        host_ids: IntArray,
        after: object,
        which: int = 0,
    ) -> None:
        """Queue a job, copied by the copier's route set ``which``; ``after`` is ignored: a CPU engine's
        work is done when it calls kvcore.

        Raises ``LaneClosed`` (nothing queued) once the lane is closed."""
        job = _Job(job_id, direction, engine_ids, host_ids, which)
        if direction is Direction.LOAD:
            self._loads[job_id] = threading.Event()
        try:
            self._lane.submit(partial(self._copy, job), partial(self._fail, job), _PRIORITY[direction])
        except LaneClosed:
            self._loads.pop(job_id, None)
            raise

    def mark(self) -> None:
        return None

    def wait_loaded(self, job_id: JobId, timeout: float) -> None:
        """Block until the load ``job_id`` is in place (returns at once for unknown or finished jobs)."""
        done = self._loads.get(job_id)
        if done is not None and not done.wait(timeout):
            raise TransferTimeout(f"load job {job_id} not finished after {timeout:.3f}s")

    def close(self, timeout: float) -> None:
        """Fail the jobs not yet started, let the running one finish, join the thread (at most
        ``timeout`` s: a copy still running then ends on its own and is reported). Idempotent."""
        self._lane.close(timeout, why="the mover closed before the copy ran")

    def _copy(self, job: _Job) -> None:
        """On the lane: the copy, after the fault hooks, whose leading failed pairs are not copied."""
        count = len(job.engine_ids)
        failed = leading_failures(self._faults, job.direction, count)
        if failed < count:
            self._copier.copy(job.direction, job.engine_ids[failed:], job.host_ids[failed:], job.which)
        error = "some blocks failed to copy" if failed else None
        self._report(job, JobResult(job.job_id, tuple(range(failed)), error))

    def _fail(self, job: _Job, why: str) -> None:
        self._report(job, JobResult(job.job_id, tuple(range(len(job.engine_ids))), why))

    def _report(self, job: _Job, result: JobResult) -> None:
        self._board.finish(result)
        done = self._loads.pop(job.job_id, None)
        if done is not None:
            done.set()
