"""Remote tiers cascading behind the pool (``kvcore.scheduling.cascade_index``,
``kvcore.execution.cascade_remote``), over the in-memory reference index and store: lookups ask each tier for
what the ones before it lack, fetches fall through the tiers, saves are written through to every tier that
admits them (or written back when the pool evicts them); a tier that fails or is down costs only its own
part."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import pytest

from kvcore.errors import UsageError
from kvcore.execution.cascade_remote import CascadeRemote
from kvcore.execution.remote import StoreRemote
from kvcore.ids import ChunkKey, JobId, LookupId
from kvcore.jobs import JobResult
from kvcore.ports import ChunkIndex, StoreItem
from kvcore.scheduling.cascade_index import CascadeIndex, ImmediateCascadeIndex, cascade_index
from kvcore.testing.memory import InMemoryChunkIndex, InMemoryChunkStore

TIMEOUT_S = 5.0
BUDGET_S = 5.0
KEYS = [ChunkKey(f"kv/c{i}") for i in range(6)]


def answer(index: ChunkIndex, chunks: Sequence[Sequence[ChunkKey]]) -> int:
    lookup_id = index.submit_lookup(chunks)
    deadline = time.monotonic() + TIMEOUT_S
    while (found := index.poll_lookup(lookup_id)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return found


def asked(index: InMemoryChunkIndex) -> list[tuple[int, int]]:
    """What each lookup asked the index: (chunks asked, chunks given as preceding)."""
    return [(len(chunks), len(preceding)) for chunks, preceding in index.asked]


def one_per_chunk(keys: Sequence[ChunkKey]) -> list[list[ChunkKey]]:
    return [[k] for k in keys]


def test_each_tier_is_asked_for_what_the_ones_before_it_lack() -> None:
    tiers = [InMemoryChunkIndex(), InMemoryChunkIndex(), InMemoryChunkIndex()]
    tiers[0].add(KEYS[:2])
    tiers[1].add(KEYS[1:4])  # a chunk the first tier also has, and two more
    tiers[2].add(KEYS[4:5])
    cascade = CascadeIndex(tiers, BUDGET_S)
    assert answer(cascade, one_per_chunk(KEYS)) == 5
    assert [asked(t) for t in tiers] == [[(6, 0)], [(4, 2)], [(2, 4)]]
    assert cascade.found == [2, 2, 1]
    assert cascade.usage() == (None, None, None)  # the reference index cannot tell its tier's usage
    # every chunk in the first tier: the others are not asked
    assert answer(cascade, one_per_chunk(KEYS[:2])) == 2
    assert len(asked(tiers[1])) == 1


def test_a_tier_that_fails_hides_none_of_the_next_tiers_chunks() -> None:
    tiers = [InMemoryChunkIndex(), InMemoryChunkIndex()]
    tiers[0].add(KEYS)
    tiers[1].add(KEYS[:3])
    cascade = CascadeIndex(tiers, BUDGET_S)
    tiers[0].fail_next(1)
    assert answer(cascade, one_per_chunk(KEYS)) == 3  # the first tier's failure: the second answers
    tiers[0].close()  # a closed (down) tier refuses at submit: skipped
    assert answer(cascade, one_per_chunk(KEYS)) == 3


def test_a_tier_still_pending_past_the_budget_is_cut_and_the_others_answer() -> None:
    now = [0.0]
    tiers = [InMemoryChunkIndex(), InMemoryChunkIndex()]
    tiers[0].add(KEYS[:2])
    tiers[1].add(KEYS)
    cascade = CascadeIndex(tiers, budget_s=1.0, clock=lambda: now[0])
    with tiers[1].stall():
        lookup_id = cascade.submit_lookup(one_per_chunk(KEYS))
        assert cascade.poll_lookup(lookup_id) is None  # the second tier is pending, within the budget
        now[0] = 1.5
        assert cascade.poll_lookup(lookup_id) == 2  # past it: the first tier's two chunks, not 0


def test_a_tier_that_keeps_failing_is_skipped_for_a_while() -> None:
    tiers = [InMemoryChunkIndex(), InMemoryChunkIndex()]
    tiers[1].add(KEYS)
    cascade = CascadeIndex(tiers, BUDGET_S)
    for _ in range(CascadeIndex.BREAKER_FAILURES):
        tiers[0].fail_next(1)
        assert answer(cascade, one_per_chunk(KEYS)) == len(KEYS)
    before = len(asked(tiers[0]))
    assert answer(cascade, one_per_chunk(KEYS)) == len(KEYS)
    assert len(asked(tiers[0])) == before  # its breaker is open: not asked, the second tier answers


def test_a_cascade_of_tiers_that_answer_at_once_answers_at_once() -> None:
    tiers = [InMemoryChunkIndex(), InMemoryChunkIndex()]
    tiers[0].add(KEYS[:1])
    tiers[1].add(KEYS[1:3])
    cascade = cascade_index(tiers, BUDGET_S)
    assert isinstance(cascade, ImmediateCascadeIndex)
    assert cascade.lookup(one_per_chunk(KEYS)) == 3
    assert cascade.found == [1, 2]


def test_a_cancelled_cascade_lookup_cancels_the_tiers_lookup_and_answers_nothing() -> None:
    tiers = [InMemoryChunkIndex(), InMemoryChunkIndex()]
    tiers[1].add(KEYS)
    cascade = CascadeIndex(tiers, BUDGET_S)
    with tiers[1].stall():
        lookup_id = cascade.submit_lookup(one_per_chunk(KEYS))
        assert cascade.poll_lookup(lookup_id) is None  # the second tier's answer is pending
        cascade.cancel_lookup(lookup_id)
    with pytest.raises(UsageError, match="unknown, cancelled or already answered"):
        cascade.poll_lookup(lookup_id)
    with pytest.raises(UsageError):  # the tier's own lookup was cancelled too
        tiers[1].poll_lookup(LookupId(1))


def test_fewer_than_two_tiers_do_not_cascade() -> None:
    with pytest.raises(UsageError, match="indexes: got 1"):
        CascadeIndex([InMemoryChunkIndex()], BUDGET_S)
    with pytest.raises(UsageError, match="tiers: got 2 with 1 admission rules"):
        CascadeRemote([StoreRemote(InMemoryChunkStore(bytearray(8)))] * 2, [1])
    with pytest.raises(UsageError, match="tiers: got 0"):
        CascadeRemote([], [])


class Stores:
    """Two in-memory stores over one host buffer, cascaded; the host holds four 64-byte values."""

    def __init__(
        self, admit_after: Sequence[int] = (1, 1), write_back: Sequence[bool] = (False, False)
    ) -> None:
        self.host = bytearray(256)
        self.stores = [InMemoryChunkStore(self.host), InMemoryChunkStore(self.host)]
        self.remotes = [StoreRemote(s) for s in self.stores]
        self.cascade = CascadeRemote(self.remotes, admit_after, write_back)

    def publish(self, key: ChunkKey, value: bytes, *, write_back: bool = False) -> bool:
        self.host[: len(value)] = value
        item = StoreItem(key, 0, len(value))
        if write_back:
            job = self.cascade.submit_write_back("kvcore-write-back", [item])
        else:
            job = self.cascade.submit_publish("r", [item])
        (result,) = self.cascade.wait([job], TIMEOUT_S)
        return result.ok

    def fetch(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """The indices of ``keys`` not fetched; each fetched value lands at 64 bytes times its index."""
        self.host[:] = bytes(len(self.host))
        items = [StoreItem(k, 64 * i, 64) for i, k in enumerate(keys)]
        (result,) = self.cascade.wait([self.cascade.submit_fetch("r", items)], TIMEOUT_S)
        return result.failed


def value(i: int) -> bytes:
    return bytes([i]) * 64


def test_a_fetch_falls_through_the_tiers_and_a_chunk_in_none_fails() -> None:
    s = Stores()
    s.stores[0].poke(KEYS[0], value(1))
    s.stores[1].poke(KEYS[1], value(2))
    s.stores[1].poke(KEYS[0], value(9))  # the first tier's copy wins
    assert s.fetch([KEYS[0], KEYS[1], KEYS[2]]) == (2,)
    assert s.host[:128] == value(1) + value(2)


def test_saves_go_through_to_every_tier_that_admits_them() -> None:
    s = Stores(admit_after=(2, 1))  # the first tier takes a chunk at its second save only
    assert s.publish(KEYS[0], value(1))
    assert [st.peek(KEYS[0]) for st in s.stores] == [None, value(1)]
    assert s.publish(KEYS[0], value(1))
    assert [st.peek(KEYS[0]) for st in s.stores] == [value(1), value(1)]


def test_a_save_no_tier_admits_yet_is_no_failure_and_goes_nowhere() -> None:
    s = Stores(admit_after=(2, 3))
    assert s.publish(KEYS[0], value(1))
    assert [st.peek(KEYS[0]) for st in s.stores] == [None, None]


def test_a_tier_written_back_takes_no_save_only_write_backs_by_its_admission_rule() -> None:
    s = Stores(admit_after=(1, 2), write_back=(False, True))
    assert s.publish(KEYS[0], value(1))  # a save: through to the first tier, counted for the second
    assert [st.peek(KEYS[0]) for st in s.stores] == [value(1), None]
    assert s.publish(KEYS[0], value(1), write_back=True)  # saved once: not admitted yet, no failure
    assert [st.peek(KEYS[0]) for st in s.stores] == [value(1), None]
    assert s.publish(KEYS[0], value(1))  # saved twice
    assert s.publish(KEYS[0], value(1), write_back=True)
    assert [st.peek(KEYS[0]) for st in s.stores] == [value(1), value(1)]
    one = Stores(write_back=(True, True))  # admit_after 1 takes a chunk never counted (forgotten)
    assert one.publish(KEYS[1], value(2), write_back=True)
    assert [st.peek(KEYS[1]) for st in one.stores] == [value(2), value(2)]
    one.stores[0].fail_next(1)
    one.stores[1].fail_next(1)
    assert not one.publish(KEYS[2], value(3), write_back=True)  # stored in no tier: failed


def test_a_single_tier_written_back_is_a_cascade_of_one() -> None:
    host = bytearray(64)
    store = InMemoryChunkStore(host)
    cascade = CascadeRemote([StoreRemote(store)], [1], [True])
    host[:] = value(4)
    (saved,) = cascade.wait([cascade.submit_publish("r", [StoreItem(KEYS[0], 0, 64)])], TIMEOUT_S)
    assert saved.ok
    assert store.peek(KEYS[0]) is None  # a save goes to no tier written through: there is none
    (written,) = cascade.wait([cascade.submit_write_back("w", [StoreItem(KEYS[0], 0, 64)])], TIMEOUT_S)
    assert written.ok
    assert store.peek(KEYS[0]) == value(4)
    cascade.close()


def test_a_save_fails_only_where_every_tier_it_went_to_failed() -> None:
    s = Stores()
    s.stores[0].fail_next(1)
    assert s.publish(KEYS[0], value(1))  # the second tier has it
    assert [st.peek(KEYS[0]) for st in s.stores] == [None, value(1)]
    s.stores[0].fail_next(1)
    s.stores[1].fail_next(1)
    assert not s.publish(KEYS[1], value(2))
    assert [st.peek(KEYS[1]) for st in s.stores] == [None, None]


class WholeJobFailures(StoreRemote):
    """A remote tier that reports a failed job as a whole (an error, no item named), as a server that
    timed out does: every item of it failed."""

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return tuple(
            JobResult(r.job_id, (), "the server timed out") if r.failed else r
            for r in super().wait(job_ids, timeout)
        )


def test_a_tier_job_failed_as_a_whole_fails_every_item_of_it() -> None:
    host = bytearray(256)
    first, second = InMemoryChunkStore(host), InMemoryChunkStore(host)
    cascade = CascadeRemote([WholeJobFailures(first), StoreRemote(second)], (1, 1))
    second.poke(KEYS[1], value(5))
    first.fail_next(1)  # the first tier's fetch fails as a whole: the second is asked for both chunks
    items = [StoreItem(KEYS[0], 0, 64), StoreItem(KEYS[1], 64, 64)]
    (result,) = cascade.wait([cascade.submit_fetch("r", items)], TIMEOUT_S)
    assert result.failed == (0,)
    assert host[64:128] == value(5)
    first.fail_next(1)
    host[:64] = value(6)
    (saved,) = cascade.wait([cascade.submit_publish("r", [StoreItem(KEYS[2], 0, 64)])], TIMEOUT_S)
    assert saved.ok  # stored in the second tier only
    assert (first.peek(KEYS[2]), second.peek(KEYS[2])) == (None, value(6))
    cascade.close()


def test_a_closed_tier_costs_only_its_own_part_and_a_closed_cascade_refuses() -> None:
    s = Stores()
    s.stores[1].poke(KEYS[0], value(3))
    s.remotes[0].close()  # the first tier is down: every call to it is refused
    assert s.fetch([KEYS[0]]) == ()
    assert s.host[:64] == value(3)
    assert s.publish(KEYS[1], value(4))
    s.cascade.close()
    with pytest.raises(UsageError, match="closed"):
        s.cascade.submit_fetch("r", [StoreItem(KEYS[0], 0, 64)])
