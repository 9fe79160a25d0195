"""Conformance suite for ``ManagedTier``: the subset that a tier managing its own memory must meet.

A backend's test module subclasses ``ManagedTierTests[MyTier]`` and defines ``make_harness``: a context
manager that yields a ``ManagedHarness`` (a ``StoreHarness`` whose ``peek``/``poke`` also take the chain
before the key, since a managed tier may address a chunk by its chain). The suite always names the true
chain, as kvcore does, so a chained tier and one that keys chunks alone both pass.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Generic, Protocol, TypeVar

import pytest

from kvcore.errors import BackendError, BackendUnavailable, InvalidSpecError
from kvcore.ids import ChunkKey, RequestId
from kvcore.jobs import JobResult
from kvcore.ports import JobQueue, ManagedTier, StoreItem
from kvcore.testing.support import (
    HarnessFixture,
    check_close,
    check_result_handed_out_once,
    check_wait_timeout_then_poll,
    fresh_keys,
    payload,
    require_capacity,
    require_failure_injection,
    require_stall,
    run_threads,
    settle,
    wait_one,
)
from kvcore.testing.values import StoreHarness, held_bytes, read_items, scribble, stage, values_for

__all__ = ["ManagedHarness", "ManagedTierTests", "new_session", "peek_chain"]

TierT = TypeVar("TierT", bound=ManagedTier)
QueueT_co = TypeVar("QueueT_co", bound=JobQueue, covariant=True)


class ManagedHarness(StoreHarness[QueueT_co], Protocol[QueueT_co]):
    """A ``StoreHarness`` for a managed tier: ``preceding`` is the chain before the key."""

    def peek(self, key: ChunkKey, preceding: Sequence[ChunkKey] = ()) -> bytes | None:
        """The value the tier holds under ``key`` after ``preceding``; ``None`` if absent."""
        ...

    def poke(self, key: ChunkKey, value: bytes, preceding: Sequence[ChunkKey] = ()) -> None:
        """Make the tier hold ``value`` under ``key`` after ``preceding``, without the backend."""
        ...


def peek_chain(harness: ManagedHarness[JobQueue], keys: Sequence[ChunkKey]) -> list[bytes | None]:
    """The values held under ``keys`` taken as one chain."""
    return [harness.peek(key, keys[:i]) for i, key in enumerate(keys)]


def new_session(tag: str) -> RequestId:
    """A session no other test (or earlier run against a shared tier) has used."""
    return RequestId(f"conformance-{tag}-{uuid.uuid4().hex[:12]}")


class ManagedTierTests(HarnessFixture[ManagedHarness[TierT]], Generic[TierT]):
    """The ``ManagedTier`` contract. Define ``make_harness``: a fresh ``ManagedHarness`` per test."""

    @staticmethod
    def _store(harness: ManagedHarness[TierT], values: Mapping[ChunkKey, bytes], base: int = 0) -> JobResult:
        job = harness.backend.submit_store(new_session("store"), stage(harness, values, base))
        return wait_one(harness.backend, job)

    @staticmethod
    def _lookup(
        harness: ManagedHarness[TierT],
        session: RequestId,
        keys: Sequence[ChunkKey],
        preceding: Sequence[ChunkKey] = (),
    ) -> int:
        lookup_id = harness.backend.submit_lookup(session, keys, preceding)
        return settle(partial(harness.backend.poll_lookup, lookup_id), f"lookup {lookup_id}")

    @staticmethod
    def _retrieve(
        harness: ManagedHarness[TierT],
        session: RequestId,
        items: Sequence[StoreItem],
        chain: Sequence[ChunkKey] = (),
    ) -> JobResult:
        scribble(harness, items)
        return wait_one(harness.backend, harness.backend.submit_retrieve(session, items, chain))

    def test_store_lookup_retrieve_round_trip_is_bit_exact(self, harness: ManagedHarness[TierT]) -> None:
        values = values_for(fresh_keys(3), 1, 100, 1000)
        assert self._store(harness, values).ok
        assert peek_chain(harness, list(values)) == list(values.values())
        session = new_session("round-trip")
        assert self._lookup(harness, session, list(values)) == 3
        items = stage(harness, values)
        assert self._retrieve(harness, session, items).ok
        assert read_items(harness, items) == list(values.values())
        harness.backend.end_session(session)

    def test_lookup_counts_leading_hits_only(self, harness: ManagedHarness[TierT]) -> None:
        # held [k0, k1, k3] -> 2
        keys = fresh_keys(4)
        for i in (0, 1, 3):
            harness.poke(keys[i], b"v", keys[:i])
        session = new_session("leading")
        assert self._lookup(harness, session, keys) == 2
        harness.backend.end_session(session)

    def test_retrieve_of_a_missing_key_is_a_failed_item(self, harness: ManagedHarness[TierT]) -> None:
        # retrieve [a, missing] -> failed (1,); a copied
        a, missing = fresh_keys(2)
        values = values_for([a, missing], 64)
        harness.poke(a, values[a])
        session = new_session("missing")
        items = stage(harness, values)
        assert self._retrieve(harness, session, items).failed == (1,)
        assert read_items(harness, items[:1]) == [values[a]]
        harness.backend.end_session(session)

    def test_failed_store_item_is_not_stored(self, harness: ManagedHarness[TierT]) -> None:
        failures = require_failure_injection(harness)
        values = values_for(fresh_keys(2), 64)
        failures.fail_next(1)
        assert self._store(harness, values).failed == (0,)
        a, b = values
        assert harness.peek(a) is None
        assert harness.peek(b, [a]) == values[b]

    def test_failed_retrieve_is_reported_and_the_others_copied(self, harness: ManagedHarness[TierT]) -> None:
        failures = require_failure_injection(harness)
        values = values_for(fresh_keys(2), 64)
        for i, (key, value) in enumerate(values.items()):
            harness.poke(key, value, list(values)[:i])
        session = new_session("failed-retrieve")
        assert self._lookup(harness, session, list(values)) == 2
        items = stage(harness, values)
        failures.fail_next(1)
        assert self._retrieve(harness, session, items).failed == (0,)
        assert read_items(harness, items[1:]) == list(values.values())[1:]
        harness.backend.end_session(session)

    def test_end_session_is_idempotent(self, harness: ManagedHarness[TierT]) -> None:
        (key,) = fresh_keys(1)
        harness.poke(key, b"v")
        session = new_session("end")
        assert self._lookup(harness, session, [key]) == 1
        harness.backend.end_session(session)
        harness.backend.end_session(session)
        harness.backend.end_session(new_session("never-started"))
        assert harness.peek(key) == b"v"

    def test_pending_lookup_answers_none(self, harness: ManagedHarness[TierT]) -> None:
        stall = require_stall(harness)
        (key,) = fresh_keys(1)
        harness.poke(key, b"v")
        session = new_session("pending")
        with stall.stall():
            lookup_id = harness.backend.submit_lookup(session, [key])
            assert harness.backend.poll_lookup(lookup_id) is None
        assert settle(partial(harness.backend.poll_lookup, lookup_id), "the pending lookup") == 1
        harness.backend.end_session(session)

    @pytest.mark.parametrize("op", ["store", "retrieve"])
    def test_out_of_range_items_raise_before_copying(self, harness: ManagedHarness[TierT], op: str) -> None:
        good, bad = fresh_keys(2)
        value = payload(64, good)
        items = [*stage(harness, {good: value}), StoreItem(bad, harness.host_size - 8, 64)]
        if op == "retrieve":
            harness.poke(good, payload(64, "stored"))
        submit = harness.backend.submit_store if op == "store" else harness.backend.submit_retrieve
        with pytest.raises(InvalidSpecError):
            submit(new_session("range"), items)
        assert harness.read_host(0, 64) == value
        assert harness.peek(good) == (None if op == "store" else payload(64, "stored"))

    def test_capacity_is_respected(self, harness: ManagedHarness[TierT]) -> None:
        capacity = require_capacity(harness).capacity
        values = values_for(fresh_keys(8), capacity // 4)
        for key, value in values.items():
            self._store(harness, {key: value})
        keys = list(values)
        assert held_bytes(harness, keys) <= capacity
        assert all(harness.peek(k) in (None, values[k]) for k in keys)

    def test_locked_hits_survive_eviction(self, harness: ManagedHarness[TierT]) -> None:
        # full with [a, b, c, d]; a locked by a lookup; store [e, f, g, h] -> a still held
        capacity = require_capacity(harness).capacity
        values = values_for(fresh_keys(8), capacity // 4)
        keys = list(values)
        for key in keys[:4]:
            self._store(harness, {key: values[key]})
        session = new_session("locked")
        assert self._lookup(harness, session, keys[:1]) == 1
        for key in keys[4:]:
            self._store(harness, {key: values[key]})
        assert harness.peek(keys[0]) == values[keys[0]]
        harness.backend.end_session(session)

    def test_wait_times_out_and_the_result_comes_later(self, harness: ManagedHarness[TierT]) -> None:
        stall = require_stall(harness)
        values = values_for(fresh_keys(1), 64)
        check_wait_timeout_then_poll(
            harness.backend,
            stall,
            lambda: harness.backend.submit_store(new_session("timeout"), stage(harness, values)),
        )
        assert peek_chain(harness, list(values)) == list(values.values())

    def test_close_refuses_new_work_and_reports_earlier_jobs(self, harness: ManagedHarness[TierT]) -> None:
        key, stored = fresh_keys(2)
        harness.poke(key, b"v")
        value = payload(64, stored)
        items = stage(harness, {stored: value})
        session = new_session("close")
        pending = harness.backend.submit_lookup(session, [key])
        result = check_close(
            harness.backend,
            harness.backend.close,
            lambda: harness.backend.submit_store(session, items),
            BackendUnavailable,
            harness,
        )
        assert harness.peek(stored) == (value if result.ok else None)
        with pytest.raises(BackendError):
            harness.backend.poll_lookup(pending)
        with pytest.raises(BackendUnavailable, match="closed"):
            harness.backend.submit_lookup(session, [key])
        with pytest.raises(BackendUnavailable, match="closed"):
            harness.backend.submit_retrieve(session, items)
        harness.backend.end_session(session)

    def test_a_result_is_handed_out_once(self, harness: ManagedHarness[TierT]) -> None:
        values = values_for(fresh_keys(1), 64)
        check_result_handed_out_once(
            harness.backend, lambda: harness.backend.submit_store(new_session("once"), stage(harness, values))
        )

    def test_concurrent_sessions_stay_correct(self, harness: ManagedHarness[TierT]) -> None:
        # 4 threads, each storing, looking up and retrieving its own keys in its own quarter of the host
        region = harness.host_size // 4

        def session_round_trip(thread: int) -> None:
            values = values_for(fresh_keys(5, f"t{thread}-"), 64, 200)
            items = stage(harness, values, thread * region)
            session = new_session(f"thread-{thread}")
            assert wait_one(harness.backend, harness.backend.submit_store(session, items)).ok
            assert self._lookup(harness, session, list(values)) == 5
            assert self._retrieve(harness, session, items).ok
            assert read_items(harness, items) == list(values.values())
            harness.backend.end_session(session)

        run_threads(4, session_round_trip)

    def test_chunks_after_a_preceding_chain_round_trip(self, harness: ManagedHarness[TierT]) -> None:
        # chain [k0, k1, k2, k3]: k0, k1 stored by one job, k2, k3 by another that names the chain
        values = values_for(fresh_keys(4), 128, 300)
        keys = list(values)
        session = new_session("chained")
        assert self._store(harness, {k: values[k] for k in keys[:2]}).ok
        tail = stage(harness, {k: values[k] for k in keys[2:]})
        assert wait_one(harness.backend, harness.backend.submit_store(session, tail, keys)).ok
        assert peek_chain(harness, keys) == list(values.values())
        assert self._lookup(harness, session, keys[2:], keys[:2]) == 2
        assert self._retrieve(harness, session, tail, keys).ok
        assert read_items(harness, tail) == [values[k] for k in keys[2:]]
        harness.backend.end_session(session)
        # a worker retrieves without a lookup of its own session: the tier locks what it reads itself
        worker = new_session("chained-worker")
        assert self._retrieve(harness, worker, tail, keys).ok
        assert read_items(harness, tail) == [values[k] for k in keys[2:]]
        harness.backend.end_session(worker)

    def test_a_store_with_a_gap_stores_the_items_given(self, harness: ManagedHarness[TierT]) -> None:
        # chain [a, b, c]; store a and c -> the chain's hits stop at b; once b is there, all three hit
        values = values_for(fresh_keys(3), 64, 96)
        a, b, c = values
        items = stage(harness, {a: values[a], c: values[c]})
        assert wait_one(
            harness.backend, harness.backend.submit_store(new_session("gap"), items, [a, b, c])
        ).ok
        session = new_session("gap-lookup")
        assert self._lookup(harness, session, [a, b, c]) == 1
        harness.backend.end_session(session)
        harness.poke(b, values[b], [a])
        session = new_session("gap-filled")
        assert self._lookup(harness, session, [a, b, c]) == 3
        assert self._retrieve(harness, session, items[1:], [a, b, c]).ok
        assert read_items(harness, items[1:]) == [values[c]]
        harness.backend.end_session(session)

    @pytest.mark.parametrize("op", ["store", "retrieve"])
    def test_an_item_outside_its_chain_fails(self, harness: ManagedHarness[TierT], op: str) -> None:
        a, stray = fresh_keys(2)
        values = values_for([a, stray], 64)
        harness.poke(a, values[a])
        items = stage(harness, values)
        session = new_session("stray")
        submit = harness.backend.submit_store if op == "store" else harness.backend.submit_retrieve
        result = wait_one(harness.backend, submit(session, items, [a]))
        assert result.failed == (1,)
        assert harness.peek(a) == values[a]
        if op == "store":
            assert harness.peek(stray, [a]) is None
        else:
            assert read_items(harness, items[:1]) == [values[a]]
        harness.backend.end_session(session)
