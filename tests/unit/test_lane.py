"""JobLane: reads before writes, FIFO within each, a raising job fails alone, close fails the queued
jobs then joins (bounded), submit after close refused, the thread named, started lazily, ended when
the lane is dropped."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvcore.errors import BackendError, KVCoreError, UsageError
from kvcore.kit.lane import JobLane, LaneClosed, Priority

SETTLE = 10.0


class Log:
    """What the jobs did, in order: ``("ran", name)`` or ``("failed", name, why)``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._grew = threading.Condition(self._lock)
        self.events: list[tuple[str, ...]] = []

    def add(self, *event: str) -> None:
        with self._grew:
            self.events.append(event)
            self._grew.notify_all()

    def run(self, name: str, body: Callable[[], object] = lambda: None) -> Callable[[], None]:
        def run() -> None:
            body()
            self.add("ran", name)

        return run

    def fail(self, name: str) -> Callable[[str], None]:
        return lambda why: self.add("failed", name, why)

    def wait_for(self, count: int) -> list[tuple[str, ...]]:
        with self._grew:
            assert self._grew.wait_for(lambda: len(self.events) >= count, SETTLE), self.events
            return list(self.events)


@pytest.fixture
def lane() -> Iterator[JobLane]:
    made = JobLane("test-lane")
    yield made
    made.close(SETTLE)


def hold(lane: JobLane, log: Log, priority: Priority = Priority.WRITE) -> threading.Event:
    """Occupy the lane with a job that waits for the returned gate; returns once it is running."""
    gate, started = threading.Event(), threading.Event()

    def body() -> None:
        started.set()
        assert gate.wait(SETTLE), "the test never opened the gate"

    lane.submit(log.run("held", body), log.fail("held"), priority)
    assert started.wait(SETTLE)
    return gate


def test_queued_reads_run_before_queued_writes_each_in_submission_order(lane: JobLane) -> None:
    log = Log()
    gate = hold(lane, log)
    for name, priority in [("w1", Priority.WRITE), ("r1", Priority.READ), ("w2", Priority.WRITE)]:
        lane.submit(log.run(name), log.fail(name), priority)
    lane.submit(log.run("r2"), log.fail("r2"), Priority.READ)
    gate.set()
    assert [e[1] for e in log.wait_for(5)] == ["held", "r1", "r2", "w1", "w2"]


def test_jobs_of_one_priority_run_in_submission_order(lane: JobLane) -> None:
    log = Log()
    gate = hold(lane, log, Priority.READ)
    names = [f"j{i}" for i in range(20)]
    for name in names:
        lane.submit(log.run(name), log.fail(name), Priority.READ)
    gate.set()
    assert [e[1] for e in log.wait_for(21)] == ["held", *names]


def test_jobs_run_on_a_thread_named_as_the_lane_started_by_the_first_submit() -> None:
    lane = JobLane("kvcore-test-named")
    assert not [t for t in threading.enumerate() if t.name == "kvcore-test-named"]
    log = Log()
    lane.submit(log.run("on", lambda: log.add("thread", threading.current_thread().name)), log.fail("on"))
    assert log.wait_for(2) == [("thread", "kvcore-test-named"), ("ran", "on")]
    assert lane.close(SETTLE)


def test_a_job_that_raises_fails_alone_and_the_lane_goes_on(
    lane: JobLane, caplog: pytest.LogCaptureFixture
) -> None:
    log = Log()

    def broken() -> None:
        raise RuntimeError("copy engine on fire")

    def refused() -> None:
        raise BackendError("master down")

    with caplog.at_level(logging.WARNING, logger="kvcore.kit.lane"):
        lane.submit(log.run("broken", broken), log.fail("broken"))
        lane.submit(log.run("refused", refused), log.fail("refused"))
        lane.submit(log.run("after"), log.fail("after"))
        events = log.wait_for(3)
    assert events == [
        ("failed", "broken", "RuntimeError: copy engine on fire"),
        ("failed", "refused", "BackendError: master down"),
        ("ran", "after"),
    ]
    # a bug is logged with its traceback, a tier failure (a KVCoreError) is only the job's result
    logged = [r for r in caplog.records if "test-lane" in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].exc_info is not None
    assert "copy engine on fire" in str(logged[0].exc_info[1])


def test_close_fails_every_queued_job_then_joins_the_thread() -> None:
    lane, log = JobLane("test-close"), Log()
    gate = hold(lane, log)
    for name in ("w1", "w2"):
        lane.submit(log.run(name), log.fail(name))
    lane.submit(log.run("r1"), log.fail("r1"), Priority.READ)

    def opens_the_gate(why: str) -> None:
        gate.set()  # so the join below returns at once, if and only if the queued jobs failed first
        log.add("failed", "r2", why)

    lane.submit(log.run("r2"), opens_the_gate, Priority.READ)
    lane.submit(log.run("r3"), log.fail("r3"), Priority.READ)
    started = time.monotonic()
    assert lane.close(SETTLE, why="closed under test")
    assert time.monotonic() - started < SETTLE / 2
    assert not [t for t in threading.enumerate() if t.name == "test-close"]
    events = log.wait_for(6)
    failed = [e for e in events if e[0] == "failed"]
    assert failed == [("failed", n, "closed under test") for n in ("r1", "r2", "r3", "w1", "w2")]
    assert ("ran", "held") in events
    assert len(events) == 6


def test_submit_after_close_is_refused_naming_the_lane() -> None:
    lane = JobLane("kvcore-refusing")
    assert lane.close(SETTLE)  # never started: nothing to join
    ran: list[str] = []
    with pytest.raises(LaneClosed, match="'kvcore-refusing' is closed") as caught:
        lane.submit(lambda: ran.append("run"), ran.append)
    assert isinstance(caught.value, UsageError)
    assert isinstance(caught.value, KVCoreError)
    assert caught.value.lane == "kvcore-refusing"
    assert ran == []


def test_close_is_idempotent_and_fails_each_job_once(lane: JobLane) -> None:
    log = Log()
    gate = hold(lane, log)
    lane.submit(log.run("queued"), log.fail("queued"))
    assert not lane.close(0.01)
    gate.set()
    assert lane.close(SETTLE)
    assert lane.close(SETTLE)
    assert log.wait_for(2) == [("failed", "queued", "the lane closed before the job ran"), ("ran", "held")]


def test_close_with_a_job_stuck_past_the_timeout_returns_and_says_so(
    lane: JobLane, caplog: pytest.LogCaptureFixture
) -> None:
    log = Log()
    gate = hold(lane, log)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvcore.kit.lane"):
        assert not lane.close(0.05)
    assert time.monotonic() - started < SETTLE / 2
    assert any("test-lane" in r.getMessage() and "after close" in r.getMessage() for r in caplog.records)
    gate.set()  # the stuck job still ends, and is reported
    assert log.wait_for(1) == [("ran", "held")]
    assert lane.close(SETTLE)


def test_a_failing_fail_neither_stops_the_lane_nor_the_close(caplog: pytest.LogCaptureFixture) -> None:
    lane, log = JobLane("test-fail-raises"), Log()

    def fail_badly(why: str) -> None:
        raise ValueError(f"the failure handler is broken ({why})")

    with caplog.at_level(logging.ERROR, logger="kvcore.kit.lane"):
        lane.submit(lambda: 1 / 0, fail_badly)
        lane.submit(log.run("next"), log.fail("next"))
        assert log.wait_for(1) == [("ran", "next")]
        gate = hold(lane, log)
        lane.submit(log.run("q1"), fail_badly)
        lane.submit(log.run("q2"), log.fail("q2"))
        assert not lane.close(0.01, why="closing")
    assert log.wait_for(2)[1] == ("failed", "q2", "closing")
    handlers = [r for r in caplog.records if "test-fail-raises" in r.getMessage()]
    assert [str(r.exc_info[1]) for r in handlers if r.exc_info] == [
        "the failure handler is broken (ZeroDivisionError: division by zero)",
        "the failure handler is broken (closing)",
    ]
    gate.set()
    assert lane.close(SETTLE)


# the lane re-raises what is not an Exception, which ends its thread: pytest reports that, on purpose here
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_job_that_ends_the_thread_fails_the_queued_ones_and_closes_the_lane() -> None:
    lane, log = JobLane("test-exit"), Log()
    gate = hold(lane, log)

    def exits() -> None:
        raise SystemExit("interpreter asked to stop")

    lane.submit(log.run("exits", exits), log.fail("exits"))
    lane.submit(log.run("after"), log.fail("after"))
    gate.set()
    events = log.wait_for(3)
    exit_text = "SystemExit: interpreter asked to stop"
    assert events[1:] == [
        ("failed", "exits", exit_text),
        ("failed", "after", f"the test-exit lane stopped before the job ran ({exit_text})"),
    ]
    with pytest.raises(LaneClosed):
        lane.submit(log.run("late"), log.fail("late"))
    assert lane.close(SETTLE)


class Owner:
    """A backend as lanes have them: it holds its lane, and its queued jobs hold it."""

    def __init__(self, log: Log) -> None:
        self.lane = JobLane("test-dropped")
        self.log = log

    def job(self) -> None:
        self.log.add("ran", "owned")


def test_a_dropped_lane_runs_what_is_queued_then_ends_its_thread() -> None:
    log = Log()
    owner = Owner(log)
    gate = hold(owner.lane, log)
    owner.lane.submit(owner.job, log.fail("owned"))
    (thread,) = [t for t in threading.enumerate() if t.name == "test-dropped"]
    del owner
    gc.collect()  # the queued job keeps its owner, and so the lane, alive
    assert thread.is_alive()
    gate.set()
    assert log.wait_for(2) == [("ran", "held"), ("ran", "owned")]
    gc.collect()  # nothing holds the owner any more, not even the idle thread
    thread.join(SETTLE)
    assert not thread.is_alive()
