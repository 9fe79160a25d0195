"""``JobLane``: the one thread on which a backend runs its queued jobs, reads before writes.

Every backend that hands work to a thread of its own (the CPU block mover, the Mooncake store and index,
the LMCache tier, the in-memory references) queues it here, so that the order, the failure of a job and
the end of the thread are the same everywhere:

- **Reads before writes.** A queued read (a load, a get, a retrieve, a lookup: an engine waits on it)
  runs before every queued write (a save, a put, a store: it only has to finish before its memory is
  reused); jobs of one priority run in submission order. A job already running is never preempted.
- **A job that raises fails, the lane goes on.** Its ``fail`` is called with ``"<type>: <message>"``
  (an exception that is not a ``KVCoreError`` is logged with its traceback: a bug, not a tier failure).
- **close** refuses new jobs (``LaneClosed``), fails every queued job that has not started (its ``fail``,
  on the closing thread, with the reason the caller gives), then joins the thread for a bounded time: a
  job still running then finishes on its own, with a warning.

The thread starts with the first job, so nothing runs at construction. A lane dropped without ``close``
runs what is queued, then its thread ends (a queued job keeps its owner, and so the lane, alive).
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import Callable

from attrs import frozen

from kvcore.errors import KVCoreError, UsageError

__all__ = ["JobLane", "LaneClosed", "Priority"]

log = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    """Which queued jobs run first: every read, then every write; lower runs first."""

    READ = 0
    WRITE = 1


_STOP = len(Priority)  # the stop marker sorts after every job


class LaneClosed(UsageError):
    """A job was submitted to a lane after its ``close``; nothing was queued."""

    def __init__(self, lane: str) -> None:
        self.lane = lane
        super().__init__(f"lane {lane!r} is closed: no job is taken after close")


@frozen(eq=False)
class _Job:
    run: Callable[[], object]
    fail: Callable[[str], object]


class _Shared:
    """What the lane's thread shares with the lane: the queue, and whether it still takes jobs. The
    thread holds this, never the lane, so that dropping the lane can end the thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.closed = False
        self.jobs: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._order = itertools.count()

    def put(self, priority: int, job: _Job | None) -> None:
        self.jobs.put((priority, next(self._order), job))

    def shut(self) -> list[_Job]:
        """Take no more jobs; the ones not started, in the order they would have run (with ``lock``)."""
        dropped: list[_Job] = []
        if self.closed:
            return dropped
        self.closed = True
        while True:
            try:
                _, _, job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                dropped.append(job)
        self.put(_STOP, None)
        return dropped

    def stop(self) -> None:
        """End the thread once the queued jobs ran (the lane was dropped without ``close``)."""
        self.put(_STOP, None)


class JobLane:
    """A daemon thread named ``name`` that runs submitted jobs, reads before writes (module docstring)."""

    def __init__(self, name: str) -> None:
        self._shared = _Shared(name)
        self._thread: threading.Thread | None = None
        weakref.finalize(self, self._shared.stop)

    @property
    def name(self) -> str:
        return self._shared.name

    def submit(
        self, run: Callable[[], object], fail: Callable[[str], object], priority: Priority = Priority.WRITE
    ) -> None:
        """Queue ``run``; ``fail(why)`` is called instead if it raises, or if the lane closes first.

        Exactly one of the two ends each job (``fail`` after a ``run`` that raised). Raises
        ``LaneClosed`` (nothing queued) once the lane is closed.
        """
        shared = self._shared
        with shared.lock:
            if shared.closed:
                raise LaneClosed(shared.name)
            if self._thread is None:
                self._thread = threading.Thread(target=_serve, args=(shared,), name=shared.name, daemon=True)
                self._thread.start()
            shared.put(priority, _Job(run, fail))

    def close(self, timeout: float, *, why: str = "the lane closed before the job ran") -> bool:
        """Refuse new jobs, ``fail(why)`` each queued one, then join the thread for at most ``timeout``
        seconds. Returns whether the thread has ended; when it has not (a job still running), a warning
        names the lane. Idempotent: a later call only joins again."""
        with self._shared.lock:
            dropped = self._shared.shut()
        for job in dropped:
            _fail(self.name, job, why)
        thread = self._thread
        if thread is None:
            return True
        if thread is not threading.current_thread():
            thread.join(timeout)
        if thread.is_alive():
            log.warning(
                "kvcore: lane %s still runs a job %.1fs after close; left to end on its own",
                self.name,
                timeout,
            )
            return False
        return True


def _serve(shared: _Shared) -> None:
    try:
        while True:
            _, _, job = shared.jobs.get()
            if job is None:
                return
            _run(shared.name, job)
            # Dropped before the next wait: the job may hold the lane's owner, whose collection ends us.
            job = None
    except BaseException as exc:  # the thread ends: no job may wait for it
        with shared.lock:
            dropped = shared.shut()
        why = f"the {shared.name} lane stopped before the job ran ({type(exc).__name__}: {exc})"
        for left in dropped:
            _fail(shared.name, left, why)
        raise


def _run(name: str, job: _Job) -> None:
    try:
        job.run()
    except Exception as exc:
        if not isinstance(exc, KVCoreError):
            log.warning("kvcore: a job on lane %s raised", name, exc_info=True)
        _fail(name, job, f"{type(exc).__name__}: {exc}")
    except BaseException as exc:
        _fail(name, job, f"{type(exc).__name__}: {exc}")
        raise


def _fail(name: str, job: _Job, why: str) -> None:
    # A failing ``fail`` must not stop the lane, nor the closing of the jobs after it.
    try:
        job.fail(why)
    except Exception:
        log.exception("kvcore: failing a job on lane %s raised", name)
