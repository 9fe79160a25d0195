"""The job queue under the fuzzer's faulty ports: each job gets a seeded fate (on time or 1 to 3 steps late,
and how many of its items fail), is held until its step comes, then runs to completion through the real
part it wraps, so that no copy depends on when a thread gets round to it."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection

from attrs import frozen

from kvcore.errors import TransferTimeout, UsageError
from kvcore.ids import JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore_cli.fuzz.trace import Clock

__all__ = ["INNER_WAIT_S", "Fate", "Postponed"]

INNER_WAIT_S = 60.0  # a real copy, run to completion when its job falls due
PATIENT_S = 10.0  # a wait this long sees a late job finish (the engine's own waits are shorter)
P_LATE = 0.3  # a job finishes 1 to 3 steps late
P_STUCK = 0.05  # of late jobs: not even a patient wait (a fence) sees it finish sooner
P_FAIL = 0.07  # a job fails, wholly or in part


@frozen
class Fate:
    """What the seed says of a new job."""

    delay: int  # steps late
    stuck: bool  # not even a patient wait runs it sooner
    failing: int  # of its items


@frozen
class _Held:
    step: int  # when it runs unasked
    stuck: bool
    items: int
    run: Callable[[JobId], JobResult]


class Postponed:
    """A job queue whose jobs run when the seed says.

    ``wait`` never blocks. A late job outlasts the engine's short waits (``TransferTimeout``) but not a
    patient one (``PATIENT_S`` or more, as a fence's): that runs it at once. A stuck job outlasts every
    wait and runs only when its step comes. ``close`` fails the jobs still held, and refuses new ones,
    as a closed mover does.
    """

    def __init__(self, clock: Clock, rng: random.Random, chaos: bool) -> None:
        self._clock = clock
        self._rng = rng
        self._chaos = chaos
        self._board = JobBoard()
        self._held: dict[JobId, _Held] = {}
        self.closed_at: int | None = None
        self.late = 0
        self.failed = 0

    def held(self) -> int:
        return len(self._held)

    def poll(self) -> tuple[JobResult, ...]:
        self._release(())
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        self._release(job_ids if timeout >= PATIENT_S else ())
        late = sorted(j for j in job_ids if j in self._held)
        if late:
            raise TransferTimeout(f"jobs {late} are held until a later step")
        return self._board.wait(job_ids, 0.0)

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = self._clock.step
        held, self._held = self._held, {}
        for job, entry in held.items():
            self._board.finish(JobResult(job, tuple(range(entry.items)), "closed before the job ran"))

    def _fate(self, items: int) -> Fate:
        """The fate of a new job of ``items`` items (none without chaos, or without items)."""
        if not self._chaos or items == 0:
            return Fate(0, False, 0)
        delay = self._rng.choice((1, 1, 2, 3)) if self._rng.random() < P_LATE else 0
        stuck = delay > 0 and self._rng.random() < P_STUCK
        failing = 0
        if self._rng.random() < P_FAIL:
            failing = items if self._rng.random() < 0.5 else self._rng.randint(1, items)
        self.late += delay > 0
        self.failed += failing > 0
        return Fate(delay, stuck, failing)

    def _hold(self, fate: Fate, items: int, run: Callable[[JobId], JobResult]) -> JobId:
        if self.closed_at is not None:
            raise UsageError(f"{type(self).__name__} is closed")
        job = self._board.new()
        self._held[job] = _Held(self._clock.step + fate.delay, fate.stuck, items, run)
        return job

    def _release(self, asked: Collection[JobId]) -> None:
        """Run the jobs whose step has come, and the asked ones that are not stuck, in submission order."""
        now = self._clock.step
        for job in [j for j, h in self._held.items() if h.step <= now or (j in asked and not h.stuck)]:
            self._board.finish(self._held.pop(job).run(job))
