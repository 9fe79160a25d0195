"""Conformance suites for ``ChunkIndex`` (and ``SupportsImmediateLookup``) and ``SupportsHeldLookups``,
and the index's state machine.

A backend's test module subclasses ``ChunkIndexTests[MyIndex]`` (and, for an index whose lookups hold
locks, ``HeldLookupTests[MyIndex]``) and defines ``make_harness``: a context manager that yields an
``IndexHarness``. ``chunk_index_state_machine(factory)`` builds the stateful test from the same factory.
For a chained index, ``make_present(keys)`` stores ``keys`` as one chain, in order.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Generic, Protocol, TypeVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvcore.errors import BackendError, BackendUnavailable, UsageError
from kvcore.ids import ChunkKey, LookupId
from kvcore.ports import ChunkIndex, SupportsClear, SupportsHeldLookups, SupportsImmediateLookup
from kvcore.testing.support import (
    RECOVERY_S,
    HarnessFixture,
    finish_machine,
    fresh_keys,
    require_capacity,
    require_clear,
    require_failure_injection,
    require_immediate_lookup,
    require_outage,
    require_pinning,
    require_stall,
    run_threads,
    settle,
)

__all__ = [
    "ChunkIndexTests",
    "check_outage",
    "HeldLookupTests",
    "IndexHarness",
    "answer",
    "chunk_index_state_machine",
    "settle_lookup",
]

IndexT = TypeVar("IndexT", bound=ChunkIndex)
IndexT_co = TypeVar("IndexT_co", bound=ChunkIndex, covariant=True)
HeldT = TypeVar("HeldT", bound=SupportsHeldLookups)


class IndexHarness(Protocol[IndexT_co]):
    """The index under test, and a way to change what its tier holds without going through it."""

    @property
    def backend(self) -> IndexT_co: ...

    def make_present(self, keys: Sequence[ChunkKey]) -> None:
        """Make the tier hold ``keys`` (out of band: not through the index)."""
        ...

    def make_absent(self, keys: Sequence[ChunkKey]) -> None:
        """Make the tier drop ``keys`` (out of band)."""
        ...


def settle_lookup(index: ChunkIndex, lookup_id: LookupId) -> int:
    """Poll a lookup to its answer; fails the test if none comes within ``SETTLE_S``."""
    return settle(partial(index.poll_lookup, lookup_id), f"lookup {lookup_id}")


def answer(
    index: ChunkIndex, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
) -> int:
    """The submitted lookup's answer; when the index also answers at once, both forms must agree."""
    hits = settle_lookup(index, index.submit_lookup(chunks, preceding))
    if isinstance(index, SupportsImmediateLookup):
        assert index.lookup(chunks) == hits, "the immediate and the submitted lookup disagree"
    return hits


def _one_per_chunk(keys: Sequence[ChunkKey]) -> list[list[ChunkKey]]:
    return [[key] for key in keys]


def check_outage(harness: IndexHarness[ChunkIndex]) -> None:
    """Two chunks present; the server goes away: a lookup asked during the outage fails
    (``BackendUnavailable`` at submit, or ``BackendError`` at a poll within ``SETTLE_S``), never answers a
    count (0 would read as a miss: no breaker opens, nobody is warned); one asked just before it may
    still have been answered, then truly (2); it comes back: so do the answers."""
    outage = require_outage(harness)
    chunks = _one_per_chunk(fresh_keys(2))
    harness.make_present([key for chunk in chunks for key in chunk])
    before = harness.backend.submit_lookup(chunks)
    with outage.outage():
        during = None
        with contextlib.suppress(BackendUnavailable):
            during = harness.backend.submit_lookup(chunks)
        with contextlib.suppress(BackendError):  # or answered before the server went away, then truly
            assert settle_lookup(harness.backend, before) == 2
        if during is not None:
            with pytest.raises(BackendError):
                settle_lookup(harness.backend, during)

    def back() -> int | None:
        try:
            return answer(harness.backend, chunks) or None
        except BackendError:  # a breaker still open: not back yet
            return None

    assert settle(back, "the index, after the outage,", RECOVERY_S) == 2


class ChunkIndexTests(HarnessFixture[IndexHarness[IndexT]], Generic[IndexT]):
    """The ``ChunkIndex`` contract. Define ``make_harness``: a fresh ``IndexHarness`` per test."""

    def test_no_chunks_is_zero(self, harness: IndexHarness[IndexT]) -> None:
        assert answer(harness.backend, []) == 0

    def test_counts_every_present_chunk(self, harness: IndexHarness[IndexT]) -> None:
        keys = fresh_keys(3)
        harness.make_present(keys)
        assert answer(harness.backend, _one_per_chunk(keys)) == 3

    def test_stops_at_the_first_missing_chunk(self, harness: IndexHarness[IndexT]) -> None:
        # present [c0, c1, c3] -> 2: c3 never counts after the miss at c2
        keys = fresh_keys(4)
        harness.make_present([keys[0], keys[1], keys[3]])
        assert answer(harness.backend, _one_per_chunk(keys)) == 2

    def test_preceding_chunks_are_not_counted(self, harness: IndexHarness[IndexT]) -> None:
        # all 4 present; chunks[k:] after preceding chunks[:k] -> 4 - k
        chunks = _one_per_chunk(fresh_keys(4))
        harness.make_present([key for chunk in chunks for key in chunk])
        assert [answer(harness.backend, chunks[k:], chunks[:k]) for k in range(5)] == [4, 3, 2, 1, 0]

    def test_a_chunk_needs_every_shard(self, harness: IndexHarness[IndexT]) -> None:
        # shards a and b of chunks 0..2, b1 missing -> 1
        a, b = fresh_keys(3, "a"), fresh_keys(3, "b")
        harness.make_present([*a, b[0], b[2]])
        assert answer(harness.backend, list(zip(a, b, strict=True))) == 1

    def test_absent_key_is_a_miss(self, harness: IndexHarness[IndexT]) -> None:
        keys = fresh_keys(2)
        harness.make_present(keys)
        harness.make_absent(keys[:1])
        assert answer(harness.backend, _one_per_chunk(keys)) == 0

    def test_immediate_lookup_matches_submitted(self, harness: IndexHarness[IndexT]) -> None:
        index = require_immediate_lookup(harness.backend)
        keys = fresh_keys(4)
        harness.make_present(keys[:3])
        chunks = _one_per_chunk(keys)
        assert [index.lookup(chunks[:n]) for n in range(5)] == [0, 1, 2, 3, 3]

    def test_cancel_is_idempotent(self, harness: IndexHarness[IndexT]) -> None:
        keys = fresh_keys(1)
        harness.make_present(keys)
        lookup_id = harness.backend.submit_lookup([keys])
        harness.backend.cancel_lookup(lookup_id)
        harness.backend.cancel_lookup(lookup_id)
        harness.backend.cancel_lookup(LookupId(2**62))
        assert answer(harness.backend, [keys]) == 1

    def test_an_unreachable_server_is_an_error_never_an_answer(self, harness: IndexHarness[IndexT]) -> None:
        check_outage(harness)

    def test_an_unknown_cancelled_or_answered_lookup_id_is_a_usage_error(
        self, harness: IndexHarness[IndexT]
    ) -> None:
        keys = fresh_keys(1)
        harness.make_present(keys)
        answered = harness.backend.submit_lookup([keys])
        assert settle_lookup(harness.backend, answered) == 1
        cancelled = harness.backend.submit_lookup([keys])
        harness.backend.cancel_lookup(cancelled)
        for lookup_id in (answered, cancelled, LookupId(2**62)):
            with pytest.raises(UsageError):
                harness.backend.poll_lookup(lookup_id)

    def test_close_refuses_lookups_and_drops_pending_ones(self, harness: IndexHarness[IndexT]) -> None:
        keys = fresh_keys(1)
        harness.make_present(keys)
        pending = harness.backend.submit_lookup([keys])
        harness.backend.close()
        harness.backend.close()
        with pytest.raises(BackendError):
            harness.backend.poll_lookup(pending)
        harness.backend.cancel_lookup(pending)
        with pytest.raises(BackendUnavailable, match="closed"):
            harness.backend.submit_lookup([keys])

    def test_cancel_drops_a_pending_lookup(self, harness: IndexHarness[IndexT]) -> None:
        stall = require_stall(harness)
        keys = fresh_keys(1)
        harness.make_present(keys)
        with stall.stall():
            harness.backend.cancel_lookup(harness.backend.submit_lookup([keys]))
        assert answer(harness.backend, [keys]) == 1

    def test_pending_lookup_answers_none(self, harness: IndexHarness[IndexT]) -> None:
        stall = require_stall(harness)
        keys = fresh_keys(2)
        harness.make_present(keys)
        with stall.stall():
            lookup_id = harness.backend.submit_lookup(_one_per_chunk(keys))
            assert harness.backend.poll_lookup(lookup_id) is None
        assert settle_lookup(harness.backend, lookup_id) == 2

    def test_failed_lookup_raises_then_the_index_recovers(self, harness: IndexHarness[IndexT]) -> None:
        failures = require_failure_injection(harness)
        keys = fresh_keys(1)
        harness.make_present(keys)
        failures.fail_next(1)
        with pytest.raises(BackendError):
            answer(harness.backend, [keys])
        assert answer(harness.backend, [keys]) == 1

    def test_clear_with_lookups_pending(self, harness: IndexHarness[IndexT]) -> None:
        tier = require_clear(harness.backend)
        stall = require_stall(harness)
        chunks = _one_per_chunk(fresh_keys(3))
        harness.make_present([c[0] for c in chunks])
        with stall.stall():
            lookup_id = harness.backend.submit_lookup(chunks)
            tier.clear()
        # the pending lookup answers from before or after the clear, never anything in between
        assert settle_lookup(harness.backend, lookup_id) in (0, 3)
        assert answer(harness.backend, chunks) == 0

    def test_capacity_bounds_the_keys_held(self, harness: IndexHarness[IndexT]) -> None:
        capacity = require_capacity(harness).capacity
        keys = fresh_keys(capacity + 3)
        for key in keys:
            harness.make_present([key])
        held = [key for key in keys if answer(harness.backend, [[key]]) == 1]
        assert len(held) <= capacity
        assert keys[-1] in held, "the key just added was evicted"

    def test_eviction_never_drops_a_pinned_key(self, harness: IndexHarness[IndexT]) -> None:
        capacity = require_capacity(harness).capacity
        pins = require_pinning(harness)
        pinned, *others = fresh_keys(2 * capacity + 1)
        harness.make_present([pinned])
        pins.pin([pinned])
        try:
            for key in others:
                harness.make_present([key])
            assert answer(harness.backend, [[pinned]]) == 1
        finally:
            pins.unpin([pinned])

    def test_concurrent_lookups_stay_correct(self, harness: IndexHarness[IndexT]) -> None:
        keys = fresh_keys(8)
        harness.make_present(keys[:5])
        chunks = _one_per_chunk(keys)

        def lookups(_: int) -> None:
            for n in range(len(chunks) + 1):
                assert answer(harness.backend, chunks[:n]) == min(n, 5)

        run_threads(4, lookups)


class HeldLookupTests(HarnessFixture[IndexHarness[HeldT]], Generic[HeldT]):
    """The ``SupportsHeldLookups`` contract: a held lookup answers as a plain one, and the locks of its
    answer are handed out once and end once. Define ``make_harness`` as for ``ChunkIndexTests``."""

    def test_an_unreachable_server_is_an_error_never_an_answer(self, harness: IndexHarness[HeldT]) -> None:
        check_outage(harness)

    def test_a_held_lookup_answers_as_a_plain_one_and_holds_its_answer(
        self, harness: IndexHarness[HeldT]
    ) -> None:
        index = harness.backend
        chunks = _one_per_chunk(fresh_keys(4))
        harness.make_present([chunk[0] for chunk in chunks[:3]])
        lookup_id = index.submit_held_lookup(chunks[1:], chunks[:1])
        assert settle_lookup(index, lookup_id) == 2
        held = index.take_held(lookup_id)
        assert held is not None
        assert (held.start, held.end, len(held.holders)) == (1, 3, 1)  # chain positions, one rank
        assert index.take_held(lookup_id) is None, "the same locks were handed out twice"
        index.release_held(held)
        index.release_held(held)  # ended already: nothing happens, nothing raises
        assert index.take_held(LookupId(2**62)) is None

    def test_each_rank_holds_its_own_locks(self, harness: IndexHarness[HeldT]) -> None:
        index = harness.backend
        keys = fresh_keys(2)
        harness.make_present(keys)
        lookup_id = index.submit_held_lookup([[key, key] for key in keys])  # two ranks, one shard
        assert settle_lookup(index, lookup_id) == 2
        held = index.take_held(lookup_id)
        assert held is not None
        assert len(held.holders) == 2
        assert index.hand_over(held)

    def test_a_miss_holds_nothing(self, harness: IndexHarness[HeldT]) -> None:
        index = harness.backend
        lookup_id = index.submit_held_lookup(_one_per_chunk(fresh_keys(2)))
        assert settle_lookup(index, lookup_id) == 0
        assert index.take_held(lookup_id) is None

    def test_a_hand_over_ends_the_hold(self, harness: IndexHarness[HeldT]) -> None:
        index = harness.backend
        keys = fresh_keys(2)
        harness.make_present(keys)
        lookup_id = index.submit_held_lookup(_one_per_chunk(keys))
        assert settle_lookup(index, lookup_id) == 2
        held = index.take_held(lookup_id)
        assert held is not None
        assert index.hand_over(held)
        assert not index.hand_over(held), "the same locks were handed over twice"
        index.release_held(held)

    def test_an_answered_lookup_cancelled_before_its_locks_are_taken_holds_nothing(
        self, harness: IndexHarness[HeldT]
    ) -> None:
        index = harness.backend
        keys = fresh_keys(1)
        harness.make_present(keys)
        lookup_id = index.submit_held_lookup([keys])
        assert settle_lookup(index, lookup_id) == 1
        index.cancel_lookup(lookup_id)
        assert index.take_held(lookup_id) is None

    def test_a_closed_index_hands_nothing_over(self, harness: IndexHarness[HeldT]) -> None:
        index = harness.backend
        keys = fresh_keys(1)
        harness.make_present(keys)
        lookup_id = index.submit_held_lookup([keys])
        assert settle_lookup(index, lookup_id) == 1
        held = index.take_held(lookup_id)
        assert held is not None
        index.close()
        assert not index.hand_over(held)
        index.release_held(held)


def chunk_index_state_machine(
    factory: Callable[[], contextlib.AbstractContextManager[IndexHarness[ChunkIndex]]],
    *,
    max_examples: int = 30,
    steps: int = 30,
) -> type[RuleBasedStateMachine]:
    """A stateful test: random presence changes and lookups, every answer checked against a set.

    ``factory`` makes a fresh harness per example, with no capacity bound. Assign the result's
    ``.TestCase`` to a ``Test*`` name in the backend's test module.
    """
    picks = st.lists(st.integers(0, 5), max_size=3)
    lookups = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=2), max_size=4)

    class ChunkIndexMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self._exit = contextlib.ExitStack()
            self.harness = self._exit.enter_context(factory())
            self.keys = fresh_keys(6)
            self.model: set[ChunkKey] = set()

        def teardown(self) -> None:
            self._exit.close()

        @rule(picked=picks)
        def make_present(self, picked: list[int]) -> None:
            keys = [self.keys[i] for i in picked]
            self.harness.make_present(keys)
            self.model.update(keys)

        @rule(picked=picks)
        def make_absent(self, picked: list[int]) -> None:
            keys = [self.keys[i] for i in picked]
            self.harness.make_absent(keys)
            self.model.difference_update(keys)

        @rule(picked=lookups)
        def lookup(self, picked: list[list[int]]) -> None:
            chunks = [[self.keys[i] for i in chunk] for chunk in picked]
            expected = sum(1 for _ in itertools.takewhile(self.model.issuperset, chunks))
            assert answer(self.harness.backend, chunks) == expected

        @rule(picked=lookups)
        def cancel(self, picked: list[list[int]]) -> None:
            lookup_id = self.harness.backend.submit_lookup([[self.keys[i] for i in c] for c in picked])
            self.harness.backend.cancel_lookup(lookup_id)

        @precondition(lambda self: isinstance(self.harness.backend, SupportsClear))
        @rule()
        def clear(self) -> None:
            require_clear(self.harness.backend).clear()
            self.model.clear()

    finish_machine(ChunkIndexMachine.TestCase, max_examples, steps)
    return ChunkIndexMachine
