"""A background thread that runs CPU copy jobs, so that saves never block the engine's thread.

Loads go before saves that are still queued (a request is waiting on a load; a save only has to finish
before its slot is used), and jobs of one direction run in submission order. The port promises no order
between a load and a save.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable

from attrs import frozen

from kvcore.errors import TransferTimeout, UsageError
from kvcore.ids import JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.ports import Direction
from kvcore_cpu.rows import IntArray

__all__ = ["CopyFn", "CpuLane"]

CopyFn = Callable[[Direction, IntArray, IntArray], tuple[int, ...]]
"""Copies one job's block pairs on the calling thread; returns the indices of pairs that failed."""

_PRIORITY = {Direction.LOAD: 0, Direction.SAVE: 1}
_STOP = 2


@frozen(eq=False)
class _Job:
    job_id: JobId
    direction: Direction
    engine_ids: IntArray
    host_ids: IntArray


class CpuLane:
    """Runs jobs with ``copy`` on one worker thread and reports them to ``board``.

    The worker is a daemon thread: it stops at ``close`` (once a copy in progress ends) and never keeps
    the interpreter alive. ``start`` after ``close`` raises ``UsageError`` instead of queueing a job that
    no thread would run.
    """

    def __init__(self, board: JobBoard, copy: CopyFn) -> None:
        self._board = board
        self._copy = copy
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._loads: dict[JobId, threading.Event] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvcore-mover", daemon=True)
        self._thread.start()

    def start(
        self, job_id: JobId, direction: Direction, engine_ids: IntArray, host_ids: IntArray, after: object
    ) -> None:
        """Queue a job; ``after`` is ignored: a CPU engine's work is done when it calls kvcore.

        Raises ``UsageError`` (nothing queued) once the lane is closed."""
        job = _Job(job_id, direction, engine_ids, host_ids)
        with self._lock:
            if self._closed:
                raise UsageError("the mover's copy lane is closed")
            if direction is Direction.LOAD:
                self._loads[job_id] = threading.Event()
            self._queue.put((_PRIORITY[direction], next(self._order), job))

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
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                _, _, job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._report(job, JobResult(job.job_id, _all(job), "the mover closed before the copy ran"))
        self._queue.put((_STOP, next(self._order), None))
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            try:
                failed = self._copy(job.direction, job.engine_ids, job.host_ids)
                result = JobResult(job.job_id, failed, "some blocks failed to copy" if failed else None)
            # Any failure of a copy is the job's failure, reported through the board, never raised here.
            except Exception as exc:
                result = JobResult(job.job_id, _all(job), f"{type(exc).__name__}: {exc}")
            self._report(job, result)

    def _report(self, job: _Job, result: JobResult) -> None:
        self._board.finish(result)
        done = self._loads.pop(job.job_id, None)
        if done is not None:
            done.set()


def _all(job: _Job) -> tuple[int, ...]:
    return tuple(range(len(job.engine_ids)))
