"""Remote lookups driven by their own thread: an engine that is away neither stalls nor fails them.

The index here is a port fake with the shape of an LMCache server's lookup (a second round sent only once
the first is answered, from inside ``poll_lookup``) and a wall-clock server; the same behaviour on a real
engine and a real server is ``tests/lmcache/test_vllm_slow_steps.py``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence

import pytest

from kvcore.errors import BackendError, UsageError
from kvcore.ids import ChunkKey, LookupId
from kvcore.scheduling.lookup_pump import LONGEST
from kvcore.scheduling.remote_lookup import PendingLookup, PrefixLookup

ROUND_S = 0.002  # the server's answer to one round
TIMEOUT_S = 0.1
AWAY_S = 0.3  # an engine step three times the deadline


class TwoRounds:
    """Answers ``found`` after ``rounds`` rounds of ``round_s`` (two of ``ROUND_S`` by default), each sent
    when a poll sees the reply to the one before; ``silent`` never answers. Fails the test if two callers
    are ever inside it at once."""

    def __init__(
        self, found: int, *, silent: bool = False, rounds: int = 2, round_s: float = ROUND_S
    ) -> None:
        self.found = found
        self.silent = silent
        self.rounds = rounds
        self.round_s = round_s
        self._ids = itertools.count(1)
        self._sent: dict[LookupId, tuple[int, float]] = {}  # round, when it was sent
        self._inside = threading.Lock()
        self.polls = 0
        self.cancelled: list[LookupId] = []

    def _enter(self) -> None:
        assert self._inside.acquire(blocking=False), "two callers inside the index at once"

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        self._enter()
        try:
            lookup_id = LookupId(next(self._ids))
            self._sent[lookup_id] = (1, time.monotonic())
            return lookup_id
        finally:
            self._inside.release()

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        self._enter()
        try:
            self.polls += 1
            if lookup_id not in self._sent:
                raise UsageError(f"lookup {lookup_id} is unknown")
            round_, sent = self._sent[lookup_id]
            if self.silent or time.monotonic() - sent < self.round_s:
                return None
            if round_ < self.rounds:
                self._sent[lookup_id] = (round_ + 1, time.monotonic())
                return None
            del self._sent[lookup_id]
            return self.found
        finally:
            self._inside.release()

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        self._enter()
        try:
            self._sent.pop(lookup_id, None)
            self.cancelled.append(lookup_id)
        finally:
            self._inside.release()

    def close(self) -> None:
        pass


def chunks(n: int) -> list[tuple[ChunkKey, ...]]:
    return [(ChunkKey(f"k{i}"),) for i in range(n)]


def resume_within(lookup: PrefixLookup, pending: PendingLookup, bound_s: float) -> int:
    deadline = time.monotonic() + bound_s
    while (answer := lookup.resume(pending)) is None:
        assert time.monotonic() < deadline, "no answer within the bound"
        time.sleep(0.001)
    return answer


def test_a_lookup_answered_while_the_engine_was_away_is_a_hit(caplog: pytest.LogCaptureFixture) -> None:
    lookup = PrefixLookup(TwoRounds(found=3), TIMEOUT_S)
    try:
        with caplog.at_level(logging.WARNING):
            pending = lookup.begin(chunks(4))
            assert isinstance(pending, PendingLookup)
            time.sleep(AWAY_S)  # one long engine step
            assert lookup.resume(pending) == 3  # answered at the engine's first look
        assert "timed out" not in caplog.text
    finally:
        lookup.close()


def test_polled_only_by_the_engine_the_same_lookup_was_a_false_miss() -> None:
    # what the pump removes: the second round waits for the engine, and the deadline counts its step
    lookup = PrefixLookup(TwoRounds(found=3), TIMEOUT_S, threaded=False)
    pending = lookup.begin(chunks(4))
    assert isinstance(pending, PendingLookup)
    time.sleep(AWAY_S)
    assert lookup.resume(pending) == 0


def test_a_silent_server_is_a_miss_at_the_deadline(caplog: pytest.LogCaptureFixture) -> None:
    index = TwoRounds(found=3, silent=True)
    lookup = PrefixLookup(index, TIMEOUT_S)
    try:
        with caplog.at_level(logging.WARNING):
            started = time.monotonic()
            pending = lookup.begin(chunks(4))
            assert isinstance(pending, PendingLookup)
            assert resume_within(lookup, pending, 10 * TIMEOUT_S) == 0
            took = time.monotonic() - started
        assert TIMEOUT_S <= took < 5 * TIMEOUT_S
        assert "timed out" in caplog.text
        assert index.cancelled == [pending.lookup_id]  # the index forgets it too
    finally:
        lookup.close()


def test_an_abandoned_lookup_is_cancelled_and_no_longer_polled() -> None:
    index = TwoRounds(found=3, silent=True)
    lookup = PrefixLookup(index, 10.0)
    try:
        pending = lookup.begin(chunks(2))
        assert isinstance(pending, PendingLookup)
        time.sleep(0.02)
        lookup.abandon(pending)
        assert index.cancelled == [pending.lookup_id]
        polls = index.polls
        time.sleep(0.05)
        assert index.polls == polls
        assert lookup.resume(pending) is None  # nothing handed out for it, ever
    finally:
        lookup.close()


def test_a_failing_index_is_a_miss_and_the_pump_goes_on() -> None:
    class Failing(TwoRounds):
        def poll_lookup(self, lookup_id: LookupId) -> int | None:
            raise BackendError("the server answered garbage")

    lookup = PrefixLookup(Failing(found=1), TIMEOUT_S)
    try:
        for _ in range(2):
            pending = lookup.begin(chunks(2))
            assert isinstance(pending, PendingLookup)
            assert resume_within(lookup, pending, 1.0) == 0
    finally:
        lookup.close()


def test_many_lookups_at_once_each_get_their_answer_and_the_index_one_caller_at_a_time() -> None:
    index = TwoRounds(found=2)
    lookup = PrefixLookup(index, 5.0)
    try:
        pending = [lookup.begin(chunks(3)) for _ in range(50)]
        for i, each in enumerate(pending):
            assert isinstance(each, PendingLookup)
            if i % 5 == 0:
                lookup.abandon(each)
        answers = [
            resume_within(lookup, each, 5.0)
            for i, each in enumerate(pending)
            if i % 5 and isinstance(each, PendingLookup)
        ]
        assert answers == [2] * 40
    finally:
        lookup.close()


def test_close_stops_the_thread() -> None:
    lookup = PrefixLookup(TwoRounds(found=1, silent=True), 10.0)
    pending = lookup.begin(chunks(1))
    assert isinstance(pending, PendingLookup)
    assert any(t.name == "kvcore-lookups" for t in threading.enumerate())
    lookup.close()
    assert not any(t.name == "kvcore-lookups" and t.is_alive() for t in threading.enumerate())


class Progressing(TwoRounds):
    """Tells when it last answered a round (``SupportsLookupProgress``)."""

    def lookup_progress(self, lookup_id: LookupId) -> float | None:
        sent = self._sent.get(lookup_id)
        return None if sent is None else sent[1]


def test_a_server_that_keeps_answering_rounds_is_slow_not_silent() -> None:
    # five rounds of 40 ms: 200 ms in all, twice the deadline, never 100 ms without an answer
    index = Progressing(found=2, rounds=5, round_s=0.04)
    lookup = PrefixLookup(index, TIMEOUT_S)
    try:
        pending = lookup.begin(chunks(2))
        assert isinstance(pending, PendingLookup)
        assert resume_within(lookup, pending, 2.0) == 2
    finally:
        lookup.close()
    # the same server, but without telling its progress: a miss at the deadline
    lookup = PrefixLookup(TwoRounds(found=2, rounds=5, round_s=0.04), TIMEOUT_S)
    try:
        pending = lookup.begin(chunks(2))
        assert isinstance(pending, PendingLookup)
        assert resume_within(lookup, pending, 2.0) == 0
    finally:
        lookup.close()


def test_a_server_that_answers_rounds_forever_is_given_up_after_the_longest_wait() -> None:
    index = Progressing(found=2, rounds=10**6, round_s=0.01)
    lookup = PrefixLookup(index, 0.05)
    try:
        started = time.monotonic()
        pending = lookup.begin(chunks(2))
        assert isinstance(pending, PendingLookup)
        assert resume_within(lookup, pending, 5.0) == 0
        assert LONGEST * 0.05 <= time.monotonic() - started < LONGEST * 0.05 + 1.0
    finally:
        lookup.close()


def test_time_the_pump_could_not_run_is_not_the_servers_silence() -> None:
    # the whole process stalls for 10 s (the pump's clock jumps) while the server is on its first round
    offset = [0.0]

    def clock() -> float:
        return time.monotonic() + offset[0]

    lookup = PrefixLookup(TwoRounds(found=3, round_s=0.2), 0.5, clock=clock)
    try:
        pending = lookup.begin(chunks(4))
        assert isinstance(pending, PendingLookup)
        offset[0] = 10.0
        assert resume_within(lookup, pending, 3.0) == 3
    finally:
        lookup.close()
