"""Conformance suite for ``ChunkStore``, and its state machine.

A backend's test module subclasses ``ChunkStoreTests[MyStore]`` and defines ``make_harness``: a context
manager that yields a ``StoreHarness``, the store, its registered host buffer, and ``peek``/``poke`` of
stored values that bypass the store, so that the store itself is what is tested.
``chunk_store_state_machine(factory)`` builds the stateful test from the same factory. The suite and
its state machine share one module: the machine checks the same contract against a model, and apart they
would drift. (The harness and the helpers the managed-tier suite shares are ``kvcore.testing.values``.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Generic, TypeVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.errors import BackendError, InvalidSpecError, UsageError
from kvcore.ids import ChunkKey
from kvcore.jobs import JobResult
from kvcore.ports import ChunkStore, StoreItem, SupportsClear
from kvcore.testing.capabilities import SupportsFailureInjection, SupportsPendingJobs
from kvcore.testing.support import (
    RECOVERY_S,
    HarnessFixture,
    check_close,
    check_result_handed_out_once,
    check_wait_timeout_then_poll,
    collect,
    finish_machine,
    fresh_keys,
    payload,
    require_capacity,
    require_clear,
    require_failure_injection,
    require_outage,
    require_stall,
    run_threads,
    settle,
    wait_one,
)
from kvcore.testing.values import StoreHarness, held_bytes, read_items, scribble, stage, values_for

__all__ = ["ChunkStoreTests", "StoreHarness", "chunk_store_state_machine"]

StoreT = TypeVar("StoreT", bound=ChunkStore)


class ChunkStoreTests(HarnessFixture[StoreHarness[StoreT]], Generic[StoreT]):
    """The ``ChunkStore`` contract. Define ``make_harness``: a fresh ``StoreHarness`` per test. A store of
    a backend that keeps values per KV head (``BackendSettings.PER_HEAD``) sets ``GATHERS_RUNS``: its
    ``StoreItem.runs`` are then tested too."""

    GATHERS_RUNS: ClassVar[bool] = False

    @staticmethod
    def _put(harness: StoreHarness[StoreT], values: Mapping[ChunkKey, bytes], base: int = 0) -> JobResult:
        return wait_one(harness.backend, harness.backend.submit_put(stage(harness, values, base)))

    @staticmethod
    def _get(harness: StoreHarness[StoreT], items: Sequence[StoreItem]) -> JobResult:
        scribble(harness, items)
        return wait_one(harness.backend, harness.backend.submit_get(items))

    def test_round_trip_is_bit_exact(self, harness: StoreHarness[StoreT]) -> None:
        values = values_for(fresh_keys(3), 1, 100, 1000)
        items = stage(harness, values)
        assert wait_one(harness.backend, harness.backend.submit_put(items)).ok
        assert [harness.peek(key) for key in values] == list(values.values())
        assert self._get(harness, items).ok
        assert read_items(harness, items) == list(values.values())

    def test_get_reads_what_was_poked(self, harness: StoreHarness[StoreT]) -> None:
        values = values_for(fresh_keys(2), 64, 300)
        for key, value in values.items():
            harness.poke(key, value)
        items = stage(harness, values)
        assert self._get(harness, items).ok
        assert read_items(harness, items) == list(values.values())

    def test_missing_key_is_a_failed_item(self, harness: StoreHarness[StoreT]) -> None:
        # get [a, missing, b] -> failed (1,); a and b copied
        a, missing, b = fresh_keys(3)
        values = values_for([a, missing, b], 64)
        harness.poke(a, values[a])
        harness.poke(b, values[b])
        items = stage(harness, values)
        assert self._get(harness, items).failed == (1,)
        assert read_items(harness, [items[0], items[2]]) == [values[a], values[b]]

    def test_get_of_another_length_is_a_miss(self, harness: StoreHarness[StoreT]) -> None:
        (key,) = fresh_keys(1)
        harness.poke(key, payload(64, key))
        assert self._get(harness, [StoreItem(key, 0, 32)]).failed == (0,)

    def test_a_value_of_runs_is_gathered_by_a_put_and_scattered_by_a_get(
        self, harness: StoreHarness[StoreT]
    ) -> None:
        if not self.GATHERS_RUNS:
            pytest.skip("the store does not declare GATHERS_RUNS (its backend keeps a value per rank)")
        key, other = fresh_keys(2)
        value = payload(700, key)
        wrote = ((0, 100), (1000, 300), (4000, 300))
        done = 0
        for offset, length in wrote:
            harness.write_host(offset, value[done : done + length])
            done += length
        put = harness.backend.submit_put([StoreItem(key, 0, len(value), wrote)])
        assert wait_one(harness.backend, put).ok
        assert harness.peek(key) == value  # one value: the runs one after another
        read = ((9000, 650), (8000, 50))  # another split, out of the host buffer's order
        got = wait_one(harness.backend, harness.backend.submit_get([StoreItem(key, 9000, len(value), read)]))
        assert got.ok
        assert harness.read_host(9000, 650) + harness.read_host(8000, 50) == value
        harness.poke(other, value)  # a value stored whole reads into runs alike
        got = wait_one(
            harness.backend, harness.backend.submit_get([StoreItem(other, 9000, len(value), read)])
        )
        assert got.ok
        assert harness.read_host(9000, 650) + harness.read_host(8000, 50) == value
        with pytest.raises(InvalidSpecError):  # runs that do not add up to the length: refused
            harness.backend.submit_get([StoreItem(key, 9000, len(value) + 1, read)])

    def test_put_is_idempotent(self, harness: StoreHarness[StoreT]) -> None:
        (key,) = fresh_keys(1)
        first, second = payload(64, "first"), payload(64, "second")
        assert self._put(harness, {key: first}).ok
        self._put(harness, {key: second})
        assert harness.peek(key) == first
        assert self._get(harness, [StoreItem(key, 0, 64)]).ok
        assert harness.read_host(0, 64) == first

    def test_exists_reports_presence(self, harness: StoreHarness[StoreT]) -> None:
        present, absent = fresh_keys(2)
        harness.poke(present, b"x")
        assert harness.backend.exists([present, absent, present]) == (True, False, True)

    def test_remove_drops_keys_and_ignores_missing_ones(self, harness: StoreHarness[StoreT]) -> None:
        a, b, missing = fresh_keys(3)
        harness.poke(a, b"a")
        harness.poke(b, b"b")
        harness.backend.remove([a, missing])
        assert harness.backend.exists([a, b]) == (False, True)
        assert harness.peek(a) is None

    def test_failed_put_leaves_a_new_key_absent(self, harness: StoreHarness[StoreT]) -> None:
        # put [a, b], first item fails -> a absent, b stored
        failures = require_failure_injection(harness)
        values = values_for(fresh_keys(2), 64)
        failures.fail_next(1)
        assert self._put(harness, values).failed == (0,)
        a, b = values
        assert harness.peek(a) is None
        assert harness.backend.exists([a]) == (False,)
        assert harness.peek(b) == values[b]

    def test_failed_put_keeps_the_earlier_value(self, harness: StoreHarness[StoreT]) -> None:
        failures = require_failure_injection(harness)
        (key,) = fresh_keys(1)
        harness.poke(key, payload(64, "earlier"))
        failures.fail_next(1)
        self._put(harness, {key: payload(64, "later")})
        assert harness.peek(key) == payload(64, "earlier")

    def test_failed_get_is_reported_and_the_others_copied(self, harness: StoreHarness[StoreT]) -> None:
        failures = require_failure_injection(harness)
        values = values_for(fresh_keys(2), 64)
        for key, value in values.items():
            harness.poke(key, value)
        items = stage(harness, values)
        failures.fail_next(1)
        assert self._get(harness, items).failed == (0,)
        assert read_items(harness, items[1:]) == list(values.values())[1:]

    @pytest.mark.parametrize("op", ["put", "get"])
    @pytest.mark.parametrize("offset", ["past the end", "negative"])
    def test_out_of_range_items_raise_before_copying(
        self, harness: StoreHarness[StoreT], op: str, offset: str
    ) -> None:
        good, bad = fresh_keys(2)
        value = payload(64, good)
        bad_item = StoreItem(bad, harness.host_size - 8 if offset == "past the end" else -8, 64)
        items = [*stage(harness, {good: value}), bad_item]
        if op == "get":
            harness.poke(good, payload(64, "stored"))
        submit = harness.backend.submit_put if op == "put" else harness.backend.submit_get
        with pytest.raises(InvalidSpecError):
            submit(items)
        assert harness.read_host(0, 64) == value
        assert harness.peek(good) == (None if op == "put" else payload(64, "stored"))

    def test_wait_times_out_and_the_result_comes_later(self, harness: StoreHarness[StoreT]) -> None:
        stall = require_stall(harness)
        values = values_for(fresh_keys(1), 64)
        check_wait_timeout_then_poll(
            harness.backend, stall, lambda: harness.backend.submit_put(stage(harness, values))
        )
        assert [harness.peek(key) for key in values] == list(values.values())

    def test_a_result_is_handed_out_once(self, harness: StoreHarness[StoreT]) -> None:
        values = values_for(fresh_keys(1), 64)
        check_result_handed_out_once(
            harness.backend, lambda: harness.backend.submit_put(stage(harness, values))
        )

    def test_close_refuses_new_jobs_and_reports_earlier_ones(self, harness: StoreHarness[StoreT]) -> None:
        values = values_for(fresh_keys(1), 64)
        items = stage(harness, values)
        result = check_close(
            harness.backend,
            harness.backend.close,
            lambda: harness.backend.submit_put(items),
            UsageError,
            harness,
        )
        assert [harness.peek(key) for key in values] == [v if result.ok else None for v in values.values()]
        with pytest.raises(UsageError, match="closed"):
            harness.backend.submit_get(items)
        if isinstance(harness, SupportsPendingJobs):
            assert harness.pending_jobs() == 0, "a get refused after close left its job pending forever"

    def test_close_ends_the_jobs_queued_before_it(self, harness: StoreHarness[StoreT]) -> None:
        # put and get held in the queue by a stall; close; the stall ends -> both are reported (done or
        # failed), never left pending
        stall = require_stall(harness)
        values = values_for(fresh_keys(2), 64)
        stored, fresh = values
        harness.poke(stored, values[stored])
        with stall.stall():
            put = harness.backend.submit_put(stage(harness, {fresh: values[fresh]}))
            get = harness.backend.submit_get([StoreItem(stored, 1024, 64)])
            harness.backend.close()
        results = collect(harness.backend, [put, get])
        assert harness.peek(fresh) in (None, values[fresh])
        assert not results[get].ok or harness.read_host(1024, 64) == values[stored]

    def test_an_unreachable_server_is_an_error_never_an_answer(self, harness: StoreHarness[StoreT]) -> None:
        # a, b stored; the server goes away: exists raises (never "absent"), put and get fail every item
        # within SETTLE_S (or are refused with BackendError); it comes back: so does the store, and what
        # it still holds reads back intact (a server may drop values while it is away: Mooncake's master
        # expires the leases of clients it could not hear from)
        outage = require_outage(harness)
        held = values_for(fresh_keys(2, "held-"), 64)
        for key, value in held.items():
            harness.poke(key, value)
        new = values_for(fresh_keys(2, "new-"), 64)
        reads = [StoreItem(key, 1024 + 64 * i, 64) for i, key in enumerate(held)]
        with outage.outage():
            with pytest.raises(BackendError):
                harness.backend.exists(list(held))
            for submit, items in (
                (harness.backend.submit_put, stage(harness, new)),
                (harness.backend.submit_get, reads),
            ):
                try:
                    job = submit(items)
                except BackendError:
                    continue
                result = wait_one(harness.backend, job)
                assert result.failed_items(len(items)) == tuple(range(len(items)))

        present: list[tuple[bool, ...]] = []

        def back() -> int | None:
            try:
                present.append(harness.backend.exists(list(held)))
            except BackendError:  # a breaker still open: not back yet
                return None
            return 1

        settle(back, "the store, after the outage,", RECOVERY_S)
        kept = [item for item, there in zip(reads, present[-1], strict=True) if there]
        if kept:
            assert self._get(harness, kept).ok
            assert read_items(harness, kept) == [held[item.key] for item in kept]

    def test_capacity_is_respected(self, harness: StoreHarness[StoreT]) -> None:
        # values of capacity/4 bytes, 8 puts -> at most 4 held, the last one among them
        capacity = require_capacity(harness).capacity
        values = values_for(fresh_keys(8), capacity // 4)
        for key, value in values.items():
            self._put(harness, {key: value})
        keys = list(values)
        assert held_bytes(harness, keys) <= capacity
        assert harness.peek(keys[-1]) == values[keys[-1]]
        assert all(harness.peek(k) in (None, values[k]) for k in keys)

    def test_eviction_never_drops_a_value_being_read(self, harness: StoreHarness[StoreT]) -> None:
        # full with [a, b, c, d]; get a in flight while [e, f, g, h] are put -> the get reads a intact
        capacity = require_capacity(harness).capacity
        stall = require_stall(harness)
        size = capacity // 4
        values = values_for(fresh_keys(8), size)
        keys = list(values)
        for key in keys[:4]:
            self._put(harness, {key: values[key]})
        read = StoreItem(keys[0], 0, size)
        with stall.stall():
            jobs = [harness.backend.submit_get([read])]
            jobs += [
                harness.backend.submit_put(stage(harness, {key: values[key]}, size * (1 + i)))
                for i, key in enumerate(keys[4:])
            ]
        results = collect(harness.backend, jobs)
        assert results[jobs[0]].ok
        assert harness.read_host(0, size) == values[keys[0]]
        assert held_bytes(harness, keys) <= capacity

    def test_clear_drops_every_value(self, harness: StoreHarness[StoreT]) -> None:
        tier = require_clear(harness.backend)
        keys = fresh_keys(3)
        for key in keys:
            harness.poke(key, b"v")
        tier.clear()
        assert harness.backend.exists(keys) == (False, False, False)
        assert [harness.peek(k) for k in keys] == [None, None, None]

    def test_clear_with_jobs_in_flight(self, harness: StoreHarness[StoreT]) -> None:
        # a stored; put [a, b] and get a in flight; clear -> a gone for good, b absent or whole
        tier = require_clear(harness.backend)
        stall = require_stall(harness)
        a, b = fresh_keys(2)
        values = values_for([a, b], 64)
        harness.poke(a, values[a])
        read = StoreItem(a, 1024, 64)
        with stall.stall():
            put = harness.backend.submit_put(stage(harness, values))
            get = harness.backend.submit_get([read])
            tier.clear()
        results = collect(harness.backend, [put, get])
        assert harness.peek(a) is None, "a put in flight resurrected a cleared value"
        assert harness.backend.exists([a]) == (False,)
        assert harness.peek(b) in (None, values[b])
        assert 1 not in results[put].failed or harness.peek(b) is None
        assert not results[get].ok or read_items(harness, [read]) == [values[a]]

    def test_concurrent_puts_and_gets_stay_correct(self, harness: StoreHarness[StoreT]) -> None:
        # 4 threads, each putting and getting back its own keys in its own quarter of the host buffer
        region = harness.host_size // 4

        def put_then_get(thread: int) -> None:
            values = values_for(fresh_keys(5, f"t{thread}-"), 64, 200)
            items = stage(harness, values, thread * region)
            assert wait_one(harness.backend, harness.backend.submit_put(items)).ok
            scribble(harness, items)
            assert wait_one(harness.backend, harness.backend.submit_get(items)).ok
            assert read_items(harness, items) == list(values.values())

        run_threads(4, put_then_get)


_SLOT = 128  # host bytes per item of a machine batch: values are 1..64 bytes, a wrong-length get 65


def chunk_store_state_machine(
    factory: Callable[[], contextlib.AbstractContextManager[StoreHarness[ChunkStore]]],
    *,
    max_examples: int = 30,
    steps: int = 30,
) -> type[RuleBasedStateMachine]:
    """A stateful test: random puts, gets, exists, removes, clears and injected failures, checked
    against a dict after every step.

    ``factory`` makes a fresh harness per example whose capacity (if any) holds 6 values of 64 bytes.
    Assign the result's ``.TestCase`` to a ``Test*`` name in the backend's test module.
    """
    picks = st.lists(st.integers(0, 5), min_size=1, max_size=4)
    batches = st.lists(
        st.tuples(st.integers(0, 5), st.binary(min_size=1, max_size=64)),
        min_size=1,
        max_size=4,
        unique_by=lambda pair: pair[0],
    )

    class ChunkStoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self._exit = contextlib.ExitStack()
            self.harness = self._exit.enter_context(factory())
            self.keys = fresh_keys(6)
            self.model: dict[ChunkKey, bytes] = {}
            self.armed = False

        def teardown(self) -> None:
            self._exit.close()

        def _check_failed(self, result: JobResult, misses: set[int]) -> None:
            failed = set(result.failed)
            assert misses <= failed, f"items {sorted(misses - failed)} should have missed"
            assert len(failed - misses) <= int(self.armed), f"unexpected failures {sorted(failed - misses)}"
            self.armed = False

        @rule(batch=batches)
        def put(self, batch: list[tuple[int, bytes]]) -> None:
            items = []
            for slot, (i, value) in enumerate(batch):
                items.append(StoreItem(self.keys[i], slot * _SLOT, len(value)))
                self.harness.write_host(slot * _SLOT, value)
            result = wait_one(self.harness.backend, self.harness.backend.submit_put(items))
            self._check_failed(result, set())
            for n, (item, (_, value)) in enumerate(zip(items, batch, strict=True)):
                if n not in result.failed:
                    self.model.setdefault(item.key, value)

        @rule(picked=picks, exact=st.booleans())
        def get(self, picked: list[int], exact: bool) -> None:
            keys = [self.keys[i] for i in picked]
            lengths = [len(self.model.get(k, b"12345678")) + (0 if exact else 1) for k in keys]
            items = [
                StoreItem(k, n * _SLOT, length)
                for n, (k, length) in enumerate(zip(keys, lengths, strict=True))
            ]
            result = wait_one(self.harness.backend, self.harness.backend.submit_get(items))
            misses = {n for n, k in enumerate(keys) if k not in self.model or not exact}
            self._check_failed(result, misses)
            for n, item in enumerate(items):
                if n not in result.failed:
                    assert self.harness.read_host(item.offset, item.length) == self.model[item.key]

        @rule(picked=picks)
        def exists(self, picked: list[int]) -> None:
            keys = [self.keys[i] for i in picked]
            assert self.harness.backend.exists(keys) == tuple(k in self.model for k in keys)

        @rule(picked=picks)
        def remove(self, picked: list[int]) -> None:
            keys = [self.keys[i] for i in picked]
            self.harness.backend.remove(keys)
            for key in keys:
                self.model.pop(key, None)

        @precondition(lambda self: isinstance(self.harness, SupportsFailureInjection) and not self.armed)
        @rule()
        def inject_failure(self) -> None:
            require_failure_injection(self.harness).fail_next(1)
            self.armed = True

        @precondition(lambda self: isinstance(self.harness.backend, SupportsClear))
        @rule()
        def clear(self) -> None:
            require_clear(self.harness.backend).clear()
            self.model.clear()

        @invariant()
        def values_match_the_model(self) -> None:
            assert {k: v for k in self.keys if (v := self.harness.peek(k)) is not None} == self.model

    finish_machine(ChunkStoreMachine.TestCase, max_examples, steps)
    return ChunkStoreMachine
