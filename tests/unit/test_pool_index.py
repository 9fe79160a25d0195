"""The block pool as a chunk index: shard keys per chunk, immediate and submitted lookups, pure reads."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcore.errors import UsageError
from kvcore.ids import ChunkKey, LookupId
from kvcore.pool.block_pool import BlockPool
from kvcore.pool.pool_index import PoolIndex
from kvcore.ports import ChunkIndex, SupportsImmediateLookup


def keys(names: str) -> list[ChunkKey]:
    """``keys("a b c")`` -> three chunk keys."""
    return [ChunkKey(name) for name in names.split()]


def chunks(spec: str) -> list[list[ChunkKey]]:
    """``chunks("a0,b0 a1,b1")`` -> two chunks of two shard keys each."""
    return [keys(chunk.replace(",", " ")) for chunk in spec.split()]


def store(pool: BlockPool, names: str) -> None:
    chunk_keys = keys(names)
    pool.prepare_store(chunk_keys)
    pool.complete_store(chunk_keys, success=True)


def test_it_is_both_ports() -> None:
    index: ChunkIndex = PoolIndex(BlockPool(1))
    immediate: SupportsImmediateLookup = PoolIndex(BlockPool(1))
    assert isinstance(index, SupportsImmediateLookup)
    assert immediate.lookup([]) == 0


def test_a_chunk_counts_only_when_every_shard_key_is_ready() -> None:
    pool = BlockPool(8)
    store(pool, "a0 b0 a1 a2 b2")
    # chunks [a0+b0, a1+b1, a2+b2]: b1 missing -> 1, chunk 2 does not count after the gap
    assert PoolIndex(pool).lookup(chunks("a0,b0 a1,b1 a2,b2")) == 1
    assert PoolIndex(pool).lookup(chunks("a0 a1 a2")) == 3


def test_a_shard_key_being_stored_is_not_ready() -> None:
    pool = BlockPool(8)
    store(pool, "a0")
    pool.prepare_store(keys("b0"))
    index = PoolIndex(pool)
    assert index.lookup(chunks("a0,b0")) == 0
    pool.complete_store(keys("b0"), success=True)
    assert index.lookup(chunks("a0,b0")) == 1


def test_no_chunks_is_zero() -> None:
    index = PoolIndex(BlockPool(1))
    assert index.lookup([]) == 0
    assert index.poll_lookup(index.submit_lookup([])) == 0


def test_a_submitted_lookup_answers_from_the_pool_at_poll_time() -> None:
    pool = BlockPool(8)
    index = PoolIndex(pool)
    store(pool, "a b")
    before_store = index.submit_lookup(chunks("a b c"))
    store(pool, "c")
    assert index.poll_lookup(before_store) == 3
    before_remove = index.submit_lookup(chunks("a b c"))
    pool.remove(keys("b"))
    assert index.poll_lookup(before_remove) == 1


def test_a_submitted_lookup_keeps_its_own_copy_of_the_chunks() -> None:
    pool = BlockPool(8)
    store(pool, "a")
    index = PoolIndex(pool)
    asked = chunks("a")
    lookup_id = index.submit_lookup(asked)
    asked[0].append(ChunkKey("x"))  # the caller reuses its list
    assert index.poll_lookup(lookup_id) == 1


def test_an_answer_is_handed_out_once() -> None:
    index = PoolIndex(BlockPool(1))
    lookup_id = index.submit_lookup(chunks("a"))
    assert index.poll_lookup(lookup_id) == 0
    with pytest.raises(UsageError, match="already answered"):
        index.poll_lookup(lookup_id)


def test_polling_an_unknown_or_cancelled_lookup_is_a_usage_error() -> None:
    index = PoolIndex(BlockPool(1))
    with pytest.raises(UsageError):
        index.poll_lookup(LookupId(7))
    lookup_id = index.submit_lookup(chunks("a"))
    index.cancel_lookup(lookup_id)
    with pytest.raises(UsageError):
        index.poll_lookup(lookup_id)


def test_cancel_is_idempotent_and_leaves_other_lookups_alone() -> None:
    pool = BlockPool(2)
    store(pool, "a")
    index = PoolIndex(pool)
    first, second = index.submit_lookup(chunks("a")), index.submit_lookup(chunks("a"))
    index.cancel_lookup(first)
    index.cancel_lookup(first)
    index.cancel_lookup(LookupId(2**62))
    assert index.poll_lookup(second) == 1
    index.cancel_lookup(second)  # already answered: ignored


def test_ids_are_never_reused() -> None:
    index = PoolIndex(BlockPool(1))
    first = index.submit_lookup([])
    index.cancel_lookup(first)
    assert index.submit_lookup([]) != first


def test_lookups_neither_touch_nor_pin() -> None:
    pool = BlockPool(2)
    store(pool, "a b")  # a is the least recently used
    pool.take_events()
    index = PoolIndex(pool)
    assert index.lookup(chunks("a")) == 1
    assert index.poll_lookup(index.submit_lookup(chunks("a"))) == 1
    assert pool.usage().pinned == 0
    assert pool.take_events() == ()
    # store [c] -> evicts a: the lookups did not make it recent
    assert pool.prepare_store(keys("c")).evicted == tuple(keys("a"))


names = st.sampled_from("abcdef")


@given(
    ready=st.sets(names),
    asked=st.lists(st.lists(names, min_size=1, max_size=3), max_size=5),
)
def test_lookup_counts_the_leading_chunks_wholly_ready(ready: set[str], asked: list[list[str]]) -> None:
    pool = BlockPool(6)
    store(pool, " ".join(sorted(ready)))
    index = PoolIndex(pool)
    as_keys = [[ChunkKey(name) for name in chunk] for chunk in asked]
    expected = sum(1 for _ in itertools.takewhile(ready.issuperset, asked))
    assert index.lookup(as_keys) == expected
    assert index.poll_lookup(index.submit_lookup(as_keys)) == expected
