"""Request lifecycle: transitions, delayed frees, and one idempotent end for every exit."""

from __future__ import annotations

import pytest

from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.scheduling.lifecycle import JobRole, Phase, RequestTable

R = RequestId("r1")
K = (ChunkKey("k1"),)


def test_plain_request_ends_at_once() -> None:
    table = RequestTable()
    table.track(R).move(Phase.COMPUTING)
    assert table.end(R, Phase.FINISHED) is False
    assert table.get(R) is None


def test_load_then_compute() -> None:
    table = RequestTable()
    table.add_job(R, JobId(1), JobRole.LOAD, K)
    assert table.track(R).phase is Phase.LOADING
    record, tracker = table.complete_job(JobId(1)) or pytest.fail("job unknown")
    assert record.keys == K
    assert tracker.phase is Phase.COMPUTING


def test_finish_with_saves_in_flight_is_delayed() -> None:
    # save in flight -> finish delays; the last completion retires the request
    table = RequestTable()
    table.track(R).move(Phase.COMPUTING)
    table.add_job(R, JobId(7), JobRole.SAVE, K)
    assert table.end(R, Phase.FINISHED) is True
    assert table.track(R).phase is Phase.SAVING
    assert table.end(R, Phase.FINISHED) is True  # idempotent while delayed
    _, tracker = table.complete_job(JobId(7)) or pytest.fail("job unknown")
    assert tracker.phase is Phase.FINISHED
    assert table.get(R) is None
    assert table.complete_job(JobId(7)) is None  # duplicate completion ignored


def test_abort_before_scheduled_is_harmless() -> None:
    table = RequestTable()
    assert table.end(RequestId("never-seen"), Phase.ABORTED) is False
    assert len(table) == 0


def test_abort_mid_load_keeps_tracker_until_job_ends() -> None:
    table = RequestTable()
    table.add_job(R, JobId(1), JobRole.LOAD, K)
    assert table.end(R, Phase.ABORTED) is True
    with pytest.raises(InvalidSpecError):
        table.add_job(R, JobId(2), JobRole.SAVE, K)  # no new work for an ended request
    _, tracker = table.complete_job(JobId(1)) or pytest.fail("job unknown")
    assert tracker.phase is Phase.ABORTED
    assert len(table) == 0
    assert table.complete_job(JobId(1)) is None  # its one job is gone too


def test_preempt_and_resume() -> None:
    table = RequestTable()
    tracker = table.track(R)
    tracker.move(Phase.COMPUTING)
    tracker.move(Phase.PREEMPTED)
    tracker.move(Phase.SCHEDULED)
    with pytest.raises(InvalidSpecError, match="scheduled -> saving"):
        tracker.move(Phase.SAVING)


def test_end_needs_a_terminal_phase() -> None:
    with pytest.raises(InvalidSpecError):
        RequestTable().end(R, Phase.COMPUTING)
