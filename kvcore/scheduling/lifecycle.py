"""Request lifecycle: one tracker per request, and the table that routes job completions back to them.

A request moves through scheduled -> (loading) -> computing -> (saving) -> finished, or is preempted (and
scheduled again) or aborted at any point, including before it was ever scheduled. Host resources (pinned
slots for loads, slots being stored) belong to jobs, never directly to requests: they are released when
the job that uses them completes, because a copy in flight may still be reading or writing them. A request
that ends with jobs in flight is therefore kept ("delayed free") until its last job completes; ending is
idempotent, whatever the path.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from attrs import frozen

from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey, JobId, RequestId

__all__ = ["JobRecord", "JobRole", "Phase", "RequestTable", "RequestTracker"]


class Phase(enum.Enum):
    SCHEDULED = "scheduled"
    LOADING = "loading"
    COMPUTING = "computing"
    SAVING = "saving"  # the engine finished the request; saves still in flight
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


_TERMINAL = frozenset({Phase.FINISHED, Phase.ABORTED})
_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.SCHEDULED: frozenset({Phase.LOADING, Phase.COMPUTING, Phase.PREEMPTED, *_TERMINAL}),
    Phase.LOADING: frozenset({Phase.COMPUTING, Phase.PREEMPTED, *_TERMINAL}),
    Phase.COMPUTING: frozenset({Phase.LOADING, Phase.SAVING, Phase.PREEMPTED, *_TERMINAL}),
    Phase.SAVING: _TERMINAL,
    Phase.PREEMPTED: frozenset({Phase.SCHEDULED, *_TERMINAL}),
    Phase.FINISHED: frozenset(),
    Phase.ABORTED: frozenset(),
}


class JobRole(enum.Enum):
    LOAD = "load"
    SAVE = "save"


@frozen
class JobRecord:
    """A job of a request and the keys it holds: pinned keys for a load, keys being stored for a save."""

    job_id: JobId
    request_id: RequestId
    role: JobRole
    keys: tuple[ChunkKey, ...]


class RequestTracker:
    """Where one request is, and which of its jobs are in flight."""

    __slots__ = ("jobs", "phase", "request_id", "saved_chunks")

    def __init__(self, request_id: RequestId) -> None:
        self.request_id = request_id
        self.phase = Phase.SCHEDULED
        self.jobs: dict[JobId, JobRecord] = {}
        self.saved_chunks = 0  # leading chunks already stored or submitted for saving

    @property
    def ended(self) -> bool:
        return self.phase in _TERMINAL or self.phase is Phase.SAVING

    def move(self, phase: Phase) -> None:
        """Change phase; a transition the lifecycle does not allow raises ``InvalidSpecError``."""
        if phase is not self.phase and phase not in _NEXT[self.phase]:
            raise InvalidSpecError(f"request {self.request_id}: {self.phase.value} -> {phase.value}")
        self.phase = phase

    def in_flight(self, role: JobRole | None = None) -> int:
        return sum(1 for r in self.jobs.values() if role is None or r.role is role)


class RequestTable:
    """All live trackers, and which request each job in flight belongs to."""

    def __init__(self) -> None:
        self._trackers: dict[RequestId, RequestTracker] = {}
        self._owners: dict[JobId, RequestId] = {}

    def __len__(self) -> int:
        return len(self._trackers)

    def __iter__(self) -> Iterator[RequestTracker]:
        return iter(list(self._trackers.values()))

    def get(self, request_id: RequestId) -> RequestTracker | None:
        return self._trackers.get(request_id)

    def track(self, request_id: RequestId) -> RequestTracker:
        """The request's tracker, created (scheduled) on first use."""
        tracker = self._trackers.get(request_id)
        if tracker is None:
            tracker = self._trackers[request_id] = RequestTracker(request_id)
        return tracker

    def add_job(
        self, request_id: RequestId, job_id: JobId, role: JobRole, keys: tuple[ChunkKey, ...]
    ) -> JobRecord:
        tracker = self.track(request_id)
        if tracker.ended:
            raise InvalidSpecError(f"request {request_id} has ended ({tracker.phase.value}); no new jobs")
        record = JobRecord(job_id, request_id, role, keys)
        tracker.jobs[job_id] = record
        self._owners[job_id] = request_id
        if role is JobRole.LOAD:
            tracker.move(Phase.LOADING)
        return record

    def complete_job(self, job_id: JobId) -> tuple[JobRecord, RequestTracker] | None:
        """Detach a finished job; ``None`` for an unknown or already completed id (duplicates ignored).

        A loading request whose last load completed moves on to computing; an ended request whose last
        job completed becomes terminal and leaves the table (see ``drained`` on the returned tracker).
        """
        request_id = self._owners.pop(job_id, None)
        if request_id is None:
            return None
        tracker = self._trackers[request_id]
        record = tracker.jobs.pop(job_id)
        if tracker.phase is Phase.LOADING and not tracker.in_flight(JobRole.LOAD):
            tracker.move(Phase.COMPUTING)
        if tracker.phase is Phase.SAVING and not tracker.jobs:
            tracker.move(Phase.FINISHED)
        if tracker.phase in _TERMINAL and not tracker.jobs:
            del self._trackers[request_id]
        return record, tracker

    def end(self, request_id: RequestId, phase: Phase) -> bool:
        """Finish or abort a request, on every exit path; idempotent.

        Returns True when jobs are still in flight: the caller must delay freeing the request's engine
        blocks until they complete (the tracker stays until then). Unknown requests (aborted before they
        were ever scheduled, or already ended) return False.
        """
        if phase not in _TERMINAL:
            raise InvalidSpecError(f"end() takes finished or aborted, not {phase.value}")
        tracker = self._trackers.get(request_id)
        if tracker is None:
            return False
        if tracker.phase in _TERMINAL or tracker.phase is Phase.SAVING:
            return bool(tracker.jobs)
        if tracker.jobs:
            tracker.phase = Phase.SAVING if phase is Phase.FINISHED else Phase.ABORTED
            return True
        tracker.move(phase)
        del self._trackers[request_id]
        return False
