"""Remote tiers cascading behind the pool (``kvcore.cascade``), over the in-memory reference index and
store: lookups ask each tier for what the ones before it lack, fetches fall through the tiers, saves are
written through to every tier that admits them; a tier that fails or is down costs only its own part."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from kvcore.cascade import CascadeIndex, CascadeRemote
from kvcore.errors import UsageError
from kvcore.ids import ChunkKey, LookupId
from kvcore.ports import ChunkIndex, StoreItem
from kvcore.remote import StoreRemote
from kvcore.testing.memory import InMemoryChunkIndex, InMemoryChunkStore

TIMEOUT_S = 5.0
KEYS = [ChunkKey(f"kv/c{i}") for i in range(6)]


def answer(index: ChunkIndex, chunks: Sequence[Sequence[ChunkKey]]) -> int:
    lookup_id = index.submit_lookup(chunks)
    deadline = time.monotonic() + TIMEOUT_S
    while (found := index.poll_lookup(lookup_id)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return found


class Recording(InMemoryChunkIndex):
    """An in-memory index that records what each lookup asked it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[int, int]] = []  # (chunks asked, chunks given as preceding)

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        self.asked.append((len(chunks), len(preceding)))
        return super().submit_lookup(chunks, preceding)


def one_per_chunk(keys: Sequence[ChunkKey]) -> list[list[ChunkKey]]:
    return [[k] for k in keys]


def test_each_tier_is_asked_for_what_the_ones_before_it_lack() -> None:
    tiers = [Recording(), Recording(), Recording()]
    tiers[0].add(KEYS[:2])
    tiers[1].add(KEYS[1:4])  # a chunk the first tier also has, and two more
    tiers[2].add(KEYS[4:5])
    cascade = CascadeIndex(tiers)
    assert answer(cascade, one_per_chunk(KEYS)) == 5
    assert [t.asked for t in tiers] == [[(6, 0)], [(4, 2)], [(2, 4)]]
    assert [c.found for c in cascade.counts] == [2, 2, 1]
    assert cascade.usage() == (None, None, None)  # the reference index cannot tell its tier's usage
    # every chunk in the first tier: the others are not asked
    assert answer(cascade, one_per_chunk(KEYS[:2])) == 2
    assert len(tiers[1].asked) == 1


def test_a_tier_that_fails_hides_none_of_the_next_tiers_chunks() -> None:
    tiers = [InMemoryChunkIndex(), InMemoryChunkIndex()]
    tiers[0].add(KEYS)
    tiers[1].add(KEYS[:3])
    cascade = CascadeIndex(tiers)
    tiers[0].fail_next(1)
    assert answer(cascade, one_per_chunk(KEYS)) == 3  # the first tier's failure: the second answers
    tiers[0].close()  # a closed (down) tier refuses at submit: skipped
    assert answer(cascade, one_per_chunk(KEYS)) == 3


def test_a_cancelled_cascade_lookup_cancels_the_tiers_lookup_and_answers_nothing() -> None:
    tiers = [InMemoryChunkIndex(), InMemoryChunkIndex()]
    tiers[1].add(KEYS)
    cascade = CascadeIndex(tiers)
    with tiers[1].stall():
        lookup_id = cascade.submit_lookup(one_per_chunk(KEYS))
        assert cascade.poll_lookup(lookup_id) is None  # the second tier's answer is pending
        cascade.cancel_lookup(lookup_id)
    assert cascade.poll_lookup(lookup_id) == 0


def test_fewer_than_two_tiers_do_not_cascade() -> None:
    with pytest.raises(UsageError, match="indexes: got 1"):
        CascadeIndex([InMemoryChunkIndex()])
    with pytest.raises(UsageError, match="tiers: got 2 with 1 admission rules"):
        CascadeRemote([StoreRemote(InMemoryChunkStore(bytearray(8)))] * 2, [1])


class Stores:
    """Two in-memory stores over one host buffer, cascaded; the host holds four 64-byte values."""

    def __init__(self, admit_after: Sequence[int] = (1, 1)) -> None:
        self.host = bytearray(256)
        self.stores = [InMemoryChunkStore(self.host), InMemoryChunkStore(self.host)]
        self.remotes = [StoreRemote(s) for s in self.stores]
        self.cascade = CascadeRemote(self.remotes, admit_after)

    def publish(self, key: ChunkKey, value: bytes) -> bool:
        self.host[: len(value)] = value
        job = self.cascade.submit_publish("r", [StoreItem(key, 0, len(value))])
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
    assert [(c.fetched, c.fetched_bytes) for c in s.cascade.counts] == [(1, 64), (1, 64)]


def test_saves_go_through_to_every_tier_that_admits_them() -> None:
    s = Stores(admit_after=(2, 1))  # the first tier takes a chunk at its second save only
    assert s.publish(KEYS[0], value(1))
    assert [st.peek(KEYS[0]) for st in s.stores] == [None, value(1)]
    assert s.publish(KEYS[0], value(1))
    assert [st.peek(KEYS[0]) for st in s.stores] == [value(1), value(1)]
    assert [c.published for c in s.cascade.counts] == [1, 2]


def test_a_save_no_tier_admits_yet_is_no_failure_and_goes_nowhere() -> None:
    s = Stores(admit_after=(2, 3))
    assert s.publish(KEYS[0], value(1))
    assert [st.peek(KEYS[0]) for st in s.stores] == [None, None]


def test_a_save_fails_only_where_every_tier_it_went_to_failed() -> None:
    s = Stores()
    s.stores[0].fail_next(1)
    assert s.publish(KEYS[0], value(1))  # the second tier has it
    assert [st.peek(KEYS[0]) for st in s.stores] == [None, value(1)]
    s.stores[0].fail_next(1)
    s.stores[1].fail_next(1)
    assert not s.publish(KEYS[1], value(2))
    assert s.cascade.counts[0].failed == 2


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
