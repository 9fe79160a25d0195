"""JobBoard: every result handed out once; waits are bounded."""

from __future__ import annotations

import threading

import pytest

from kvcore.errors import TransferTimeout
from kvcore.jobs import JobBoard, JobResult


def test_poll_hands_out_once() -> None:
    board = JobBoard()
    a, b = board.new(), board.new()
    board.finish(JobResult(b))
    board.finish(JobResult(a, failed=(0,)))
    assert [r.job_id for r in board.poll()] == [a, b]
    assert board.poll() == ()
    assert board.in_flight() == 0


def test_wait_times_out_and_result_arrives_later() -> None:
    board = JobBoard()
    job = board.new()
    with pytest.raises(TransferTimeout):
        board.wait([job], 0.01)
    threading.Timer(0.01, board.finish, [JobResult(job)]).start()
    (result,) = board.wait([job], 5)
    assert result.ok


def test_unknown_and_duplicate_results_are_ignored() -> None:
    board = JobBoard()
    job = board.new()
    board.finish(JobResult(job, error="boom"))
    board.finish(JobResult(job))  # duplicate
    (result,) = board.poll()
    assert not result.ok
    assert result.error == "boom"


def test_failed_items_are_those_named_else_every_item_of_a_job_that_failed_whole() -> None:
    job = JobBoard().new()
    assert JobResult(job).failed_items(3) == ()
    assert JobResult(job, (2,), "1 of 3 reads failed").failed_items(3) == (2,)  # the others completed
    assert JobResult(job, error="the server is gone").failed_items(3) == (0, 1, 2)
