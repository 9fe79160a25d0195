"""Conformance suite for ``ManagedTier``: the subset that a tier managing its own memory must meet.

A backend's test module subclasses ``ManagedTierTests[MyTier]`` and defines ``make_harness``: a context
manager that yields a ``StoreHarness`` (the same harness shape as for a ``ChunkStore``).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Generic, TypeVar

import pytest

from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey, RequestId
from kvcore.jobs import JobResult
from kvcore.ports import ManagedTier, StoreItem
from kvcore.testing.store import StoreHarness, held_bytes, read_items, scribble, stage, values_for
from kvcore.testing.support import (
    HarnessFixture,
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

__all__ = ["ManagedTierTests"]

TierT = TypeVar("TierT", bound=ManagedTier)


def _session(tag: str) -> RequestId:
    return RequestId(f"conformance-{tag}-{uuid.uuid4().hex[:12]}")


class ManagedTierTests(HarnessFixture[StoreHarness[TierT]], Generic[TierT]):
    """The ``ManagedTier`` contract. Define ``make_harness``: a fresh ``StoreHarness`` per test."""

    @staticmethod
    def _store(harness: StoreHarness[TierT], values: Mapping[ChunkKey, bytes], base: int = 0) -> JobResult:
        job = harness.backend.submit_store(_session("store"), stage(harness, values, base))
        return wait_one(harness.backend, job)

    @staticmethod
    def _lookup(harness: StoreHarness[TierT], session: RequestId, keys: Sequence[ChunkKey]) -> int:
        lookup_id = harness.backend.submit_lookup(session, keys)
        return settle(partial(harness.backend.poll_lookup, lookup_id), f"lookup {lookup_id}")

    @staticmethod
    def _retrieve(harness: StoreHarness[TierT], session: RequestId, items: Sequence[StoreItem]) -> JobResult:
        scribble(harness, items)
        return wait_one(harness.backend, harness.backend.submit_retrieve(session, items))

    def test_store_lookup_retrieve_round_trip_is_bit_exact(self, harness: StoreHarness[TierT]) -> None:
        values = values_for(fresh_keys(3), 1, 100, 1000)
        assert self._store(harness, values).ok
        assert [harness.peek(key) for key in values] == list(values.values())
        session = _session("round-trip")
        assert self._lookup(harness, session, list(values)) == 3
        items = stage(harness, values)
        assert self._retrieve(harness, session, items).ok
        assert read_items(harness, items) == list(values.values())
        harness.backend.end_session(session)

    def test_lookup_counts_leading_hits_only(self, harness: StoreHarness[TierT]) -> None:
        # held [k0, k1, k3] -> 2
        keys = fresh_keys(4)
        for key in (keys[0], keys[1], keys[3]):
            harness.poke(key, b"v")
        session = _session("leading")
        assert self._lookup(harness, session, keys) == 2
        harness.backend.end_session(session)

    def test_retrieve_of_a_missing_key_is_a_failed_item(self, harness: StoreHarness[TierT]) -> None:
        # retrieve [a, missing] -> failed (1,); a copied
        a, missing = fresh_keys(2)
        values = values_for([a, missing], 64)
        harness.poke(a, values[a])
        session = _session("missing")
        items = stage(harness, values)
        assert self._retrieve(harness, session, items).failed == (1,)
        assert read_items(harness, items[:1]) == [values[a]]
        harness.backend.end_session(session)

    def test_failed_store_item_is_not_stored(self, harness: StoreHarness[TierT]) -> None:
        failures = require_failure_injection(harness)
        values = values_for(fresh_keys(2), 64)
        failures.fail_next(1)
        assert self._store(harness, values).failed == (0,)
        a, b = values
        assert harness.peek(a) is None
        assert harness.peek(b) == values[b]

    def test_failed_retrieve_is_reported_and_the_others_copied(self, harness: StoreHarness[TierT]) -> None:
        failures = require_failure_injection(harness)
        values = values_for(fresh_keys(2), 64)
        for key, value in values.items():
            harness.poke(key, value)
        session = _session("failed-retrieve")
        assert self._lookup(harness, session, list(values)) == 2
        items = stage(harness, values)
        failures.fail_next(1)
        assert self._retrieve(harness, session, items).failed == (0,)
        assert read_items(harness, items[1:]) == list(values.values())[1:]
        harness.backend.end_session(session)

    def test_end_session_is_idempotent(self, harness: StoreHarness[TierT]) -> None:
        (key,) = fresh_keys(1)
        harness.poke(key, b"v")
        session = _session("end")
        assert self._lookup(harness, session, [key]) == 1
        harness.backend.end_session(session)
        harness.backend.end_session(session)
        harness.backend.end_session(_session("never-started"))
        assert harness.peek(key) == b"v"

    def test_pending_lookup_answers_none(self, harness: StoreHarness[TierT]) -> None:
        stall = require_stall(harness)
        (key,) = fresh_keys(1)
        harness.poke(key, b"v")
        session = _session("pending")
        with stall.stall():
            lookup_id = harness.backend.submit_lookup(session, [key])
            assert harness.backend.poll_lookup(lookup_id) is None
        assert settle(partial(harness.backend.poll_lookup, lookup_id), "the pending lookup") == 1
        harness.backend.end_session(session)

    @pytest.mark.parametrize("op", ["store", "retrieve"])
    def test_out_of_range_items_raise_before_copying(self, harness: StoreHarness[TierT], op: str) -> None:
        good, bad = fresh_keys(2)
        value = payload(64, good)
        items = [*stage(harness, {good: value}), StoreItem(bad, harness.host_size - 8, 64)]
        if op == "retrieve":
            harness.poke(good, payload(64, "stored"))
        submit = harness.backend.submit_store if op == "store" else harness.backend.submit_retrieve
        with pytest.raises(InvalidSpecError):
            submit(_session("range"), items)
        assert harness.read_host(0, 64) == value
        assert harness.peek(good) == (None if op == "store" else payload(64, "stored"))

    def test_capacity_is_respected(self, harness: StoreHarness[TierT]) -> None:
        capacity = require_capacity(harness).capacity
        values = values_for(fresh_keys(8), capacity // 4)
        for key, value in values.items():
            self._store(harness, {key: value})
        keys = list(values)
        assert held_bytes(harness, keys) <= capacity
        assert all(harness.peek(k) in (None, values[k]) for k in keys)

    def test_locked_hits_survive_eviction(self, harness: StoreHarness[TierT]) -> None:
        # full with [a, b, c, d]; a locked by a lookup; store [e, f, g, h] -> a still held
        capacity = require_capacity(harness).capacity
        values = values_for(fresh_keys(8), capacity // 4)
        keys = list(values)
        for key in keys[:4]:
            self._store(harness, {key: values[key]})
        session = _session("locked")
        assert self._lookup(harness, session, keys[:1]) == 1
        for key in keys[4:]:
            self._store(harness, {key: values[key]})
        assert harness.peek(keys[0]) == values[keys[0]]
        harness.backend.end_session(session)

    def test_wait_times_out_and_the_result_comes_later(self, harness: StoreHarness[TierT]) -> None:
        stall = require_stall(harness)
        values = values_for(fresh_keys(1), 64)
        check_wait_timeout_then_poll(
            harness.backend,
            stall,
            lambda: harness.backend.submit_store(_session("timeout"), stage(harness, values)),
        )
        assert [harness.peek(key) for key in values] == list(values.values())

    def test_a_result_is_handed_out_once(self, harness: StoreHarness[TierT]) -> None:
        values = values_for(fresh_keys(1), 64)
        check_result_handed_out_once(
            harness.backend, lambda: harness.backend.submit_store(_session("once"), stage(harness, values))
        )

    def test_concurrent_sessions_stay_correct(self, harness: StoreHarness[TierT]) -> None:
        # 4 threads, each storing, looking up and retrieving its own keys in its own quarter of the host
        region = harness.host_size // 4

        def session_round_trip(thread: int) -> None:
            values = values_for(fresh_keys(5, f"t{thread}-"), 64, 200)
            items = stage(harness, values, thread * region)
            session = _session(f"thread-{thread}")
            assert wait_one(harness.backend, harness.backend.submit_store(session, items)).ok
            assert self._lookup(harness, session, list(values)) == 5
            assert self._retrieve(harness, session, items).ok
            assert read_items(harness, items) == list(values.values())
            harness.backend.end_session(session)

        run_threads(4, session_round_trip)
