"""The block pool, scenario by scenario: lookups, two-phase stores, eviction, pins, events, removal and
reset."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcore.errors import ConfigError, InvalidSpecError
from kvcore.ids import ChunkKey
from kvcore.pool.block_pool import BlockPool, PoolEvent, PoolEventKind, PoolUsage
from kvcore.pool.eviction import LRUPolicy, make_policy

STORED, REMOVED = PoolEventKind.STORED, PoolEventKind.REMOVED


def keys(names: str) -> list[ChunkKey]:
    """``keys("a b c")`` -> three chunk keys."""
    return [ChunkKey(name) for name in names.split()]


def store(pool: BlockPool, names: str) -> None:
    chunk_keys = keys(names)
    pool.prepare_store(chunk_keys)
    pool.complete_store(chunk_keys, success=True)


def ready(pool: BlockPool, names: str) -> list[str]:
    """Which of ``names`` are ready, each looked up alone."""
    return [name for name in names.split() if pool.lookup(keys(name)) == 1]


# -- lookups -------------------------------------------------------------------------------------------


def test_a_pool_of_any_size_costs_nothing_until_used() -> None:
    pool = BlockPool(2**62)  # a list of every free slot would not fit in any host's memory
    plan = pool.prepare_store([ChunkKey("a"), ChunkKey("b")])
    assert [slot for _, slot in plan.slots] == [0, 1]  # consecutive, from the first
    pool.complete_store([ChunkKey("a")], success=False)
    assert pool.prepare_store([ChunkKey("c")]).slots == ((ChunkKey("c"), 0),)  # given back: taken first
    assert pool.usage().used == 2
    assert pool.usage().capacity == 2**62


def test_lookup_counts_leading_ready_keys_only() -> None:
    pool = BlockPool(8)
    store(pool, "a b c")
    assert pool.lookup(keys("a b x c")) == 2  # x is a gap: c does not count
    assert pool.lookup(keys("x a")) == 0
    assert pool.lookup(keys("a b c")) == 3
    assert pool.lookup([]) == 0


def test_keys_being_stored_are_invisible_until_completed() -> None:
    pool = BlockPool(8)
    pool.prepare_store(keys("a b"))
    assert pool.lookup(keys("a")) == 0
    with pytest.raises(InvalidSpecError):
        pool.slots_of(keys("a"))
    pool.complete_store(keys("a b"), success=True)
    assert pool.lookup(keys("a b")) == 2


def test_slots_of_gives_the_planned_slots() -> None:
    pool = BlockPool(8)
    plan = pool.prepare_store(keys("a b c"))
    pool.complete_store(keys("a b c"), success=True)
    planned = dict(plan.slots)
    assert pool.slots_of(keys("c a")) == (planned[ChunkKey("c")], planned[ChunkKey("a")])
    assert len({slot for _, slot in plan.slots}) == 3
    assert all(0 <= slot < 8 for _, slot in plan.slots)


def test_slots_of_a_missing_key_is_an_invalid_spec_not_a_key_error() -> None:
    pool = BlockPool(8)
    store(pool, "a")
    with pytest.raises(InvalidSpecError, match="'x'"):
        pool.slots_of(keys("a x"))


# -- two-phase store -----------------------------------------------------------------------------------


def test_prepare_skips_keys_ready_or_in_progress() -> None:
    pool = BlockPool(8)
    store(pool, "a")
    pool.prepare_store(keys("b"))
    # store [a, b, c]: a is ready, b in progress -> only c gets a slot
    plan = pool.prepare_store(keys("a b c"))
    assert [key for key, _ in plan.slots] == keys("c")
    assert plan.skipped == 2
    assert plan.evicted == ()


def test_a_key_given_twice_is_stored_once() -> None:
    pool = BlockPool(8)
    plan = pool.prepare_store(keys("a a b"))
    assert [key for key, _ in plan.slots] == keys("a b")
    assert plan.skipped == 1
    pool.complete_store(keys("a a b"), success=True)
    assert pool.usage().ready == 2
    assert pool.usage().used == 2


def test_full_pool_evicts_least_recently_used() -> None:
    pool = BlockPool(3)
    store(pool, "a b c")
    pool.touch(keys("a"))
    # store [d] into a full pool -> evicts [b] (a was touched)
    plan = pool.prepare_store(keys("d"))
    assert plan.evicted == tuple(keys("b"))
    pool.complete_store(keys("d"), success=True)
    assert ready(pool, "a b c d") == ["a", "c", "d"]
    assert pool.usage().evictions == 1


def test_evicted_slot_is_reused_for_the_new_key() -> None:
    pool = BlockPool(1)
    store(pool, "a")
    (old,) = pool.slots_of(keys("a"))
    plan = pool.prepare_store(keys("b"))
    assert plan.slots == ((ChunkKey("b"), old),)


def test_touch_ignores_unknown_and_in_progress_keys() -> None:
    pool = BlockPool(2)
    store(pool, "a")
    pool.prepare_store(keys("b"))
    pool.touch(keys("x b a"))
    assert pool.usage() == PoolUsage(
        capacity=2, used=2, ready=1, storing=1, pinned=0, evictions=0, evictable=1
    )


def test_store_never_evicts_a_chunk_of_its_own_list() -> None:
    pool = BlockPool(2)
    store(pool, "a b")  # a is the least recently used
    # store [a, c]: a is ready, c is new -> evict b, not a (a is part of the same prefix)
    plan = pool.prepare_store(keys("a c"))
    assert plan.evicted == tuple(keys("b"))
    pool.complete_store(keys("c"), success=True)
    assert pool.lookup(keys("a c")) == 2


def test_full_of_pinned_entries_allocates_the_leading_run_that_fits() -> None:
    pool = BlockPool(3)
    store(pool, "a b c")
    pool.pin(keys("a b"))
    # store [d, e, f] with only c evictable -> d gets c's slot, e and f get nothing
    plan = pool.prepare_store(keys("d e f"))
    assert [key for key, _ in plan.slots] == keys("d")
    assert plan.evicted == tuple(keys("c"))
    assert plan.skipped == 0
    # everything is pinned or being stored now -> an empty plan, not an error
    empty = pool.prepare_store(keys("e"))
    assert empty.slots == ()
    assert empty.evicted == ()
    assert pool.usage() == PoolUsage(capacity=3, used=3, ready=2, storing=1, pinned=2, evictions=1)


def test_a_key_after_the_first_gap_gets_no_slot_even_if_one_frees_later() -> None:
    pool = BlockPool(2)
    store(pool, "a")
    pool.pin(keys("a"))
    # store [b, c] with one free slot -> only b: c would follow a gap if b failed
    plan = pool.prepare_store(keys("b c"))
    assert [key for key, _ in plan.slots] == keys("b")


def test_failed_store_frees_its_slots_and_publishes_nothing() -> None:
    pool = BlockPool(2)
    pool.prepare_store(keys("a b"))
    pool.complete_store(keys("a b"), success=False)
    assert pool.lookup(keys("a")) == 0
    assert pool.usage().used == 0
    assert pool.take_events() == ()
    # the slots are free again: no eviction needed
    plan = pool.prepare_store(keys("c d"))
    assert len(plan.slots) == 2
    assert plan.evicted == ()


def test_complete_store_is_idempotent_and_ignores_unknown_keys() -> None:
    pool = BlockPool(4)
    pool.prepare_store(keys("a"))
    pool.complete_store(keys("a"), success=True)
    pool.take_events()
    pool.complete_store(keys("a"), success=True)  # again: nothing changes
    pool.complete_store(keys("a"), success=False)  # a late failure of a finished store: ignored
    pool.complete_store(keys("x"), success=True)  # never prepared: ignored
    assert pool.lookup(keys("a")) == 1
    assert pool.take_events() == ()
    assert pool.usage() == PoolUsage(
        capacity=4, used=1, ready=1, storing=0, pinned=0, evictions=0, evictable=1
    )


def test_completing_part_of_a_plan_leaves_the_rest_in_progress() -> None:
    pool = BlockPool(4)
    pool.prepare_store(keys("a b"))
    pool.complete_store(keys("b"), success=True)
    assert ready(pool, "a b") == ["b"]
    assert pool.usage().storing == 1


# -- events --------------------------------------------------------------------------------------------


def test_events_report_stores_and_evictions_in_order() -> None:
    pool = BlockPool(2)
    store(pool, "a b")
    store(pool, "c")  # evicts a
    assert pool.take_events() == (
        PoolEvent(STORED, tuple(keys("a b"))),
        PoolEvent(REMOVED, tuple(keys("a"))),
        PoolEvent(STORED, tuple(keys("c"))),
    )
    assert pool.take_events() == ()


def test_events_can_be_turned_off() -> None:
    pool = BlockPool(1, record_events=False)
    store(pool, "a b")
    pool.reset()
    assert pool.take_events() == ()


# -- pins ----------------------------------------------------------------------------------------------


def test_pinned_entry_is_never_evicted_and_returns_at_its_last_unpin_as_most_recent() -> None:
    pool = BlockPool(2)
    store(pool, "a b")
    assert pool.pin(keys("a")) == pool.slots_of(keys("a"))
    store(pool, "c")  # a pinned -> evicts b
    assert ready(pool, "a b c") == ["a", "c"]
    pool.unpin(keys("a"))  # a comes back after c
    store(pool, "d")  # -> evicts c
    assert ready(pool, "a c d") == ["a", "d"]


def test_pins_nest() -> None:
    pool = BlockPool(1)
    store(pool, "a")
    pool.pin(keys("a"))
    pool.pin(keys("a"))
    pool.unpin(keys("a"))
    assert pool.prepare_store(keys("b")).slots == ()  # still pinned once
    pool.unpin(keys("a"))
    assert pool.prepare_store(keys("b")).evicted == tuple(keys("a"))


def test_pin_of_a_key_not_ready_pins_nothing() -> None:
    pool = BlockPool(1)
    store(pool, "a")
    with pytest.raises(InvalidSpecError, match="'x'"):
        pool.pin(keys("a x"))
    assert pool.usage().pinned == 0
    assert pool.prepare_store(keys("b")).evicted == tuple(keys("a"))


def test_unpin_of_an_unpinned_key_is_refused_and_changes_nothing() -> None:
    pool = BlockPool(2)
    store(pool, "a b")
    pool.pin(keys("a"))
    with pytest.raises(InvalidSpecError, match="'b'"):
        pool.unpin(keys("a b"))
    with pytest.raises(InvalidSpecError, match="more times"):
        pool.unpin(keys("a a"))
    assert pool.usage().pinned == 1


# -- removal -------------------------------------------------------------------------------------------


def test_remove_drops_ready_keys_frees_their_slots_and_reports_them() -> None:
    pool = BlockPool(4)
    store(pool, "a b c")
    pool.take_events()
    # remove [a, c] -> 2 removed, b stays; one REMOVED event in the order given
    assert pool.remove(keys("c a")) == 2
    assert ready(pool, "a b c") == ["b"]
    assert pool.take_events() == (PoolEvent(REMOVED, tuple(keys("c a"))),)
    assert pool.usage() == PoolUsage(
        capacity=4, used=1, ready=1, storing=0, pinned=0, evictions=0, evictable=1
    )


def test_remove_ignores_absent_keys_and_counts_a_repeated_key_once() -> None:
    pool = BlockPool(4)
    store(pool, "a")
    pool.take_events()
    # remove [x, a, a] -> only a, once
    assert pool.remove(keys("x a a")) == 1
    assert pool.take_events() == (PoolEvent(REMOVED, tuple(keys("a"))),)
    # nothing left to remove -> 0 and no event
    assert pool.remove(keys("a x")) == 0
    assert pool.take_events() == ()


def test_remove_leaves_a_pinned_key_until_it_is_unpinned() -> None:
    pool = BlockPool(2)
    store(pool, "a b")
    pool.pin(keys("a"))  # a load reads a: its slot must not be reused under it
    assert pool.remove(keys("a b")) == 1
    assert ready(pool, "a b") == ["a"]
    pool.unpin(keys("a"))
    assert pool.remove(keys("a")) == 1
    assert pool.usage().used == 0


def test_remove_leaves_a_store_in_progress_alone() -> None:
    pool = BlockPool(2)
    pool.prepare_store(keys("a"))
    assert pool.remove(keys("a")) == 0
    pool.complete_store(keys("a"), success=True)
    assert ready(pool, "a") == ["a"]


def test_a_removed_slot_is_reused_without_evicting() -> None:
    pool = BlockPool(2)
    store(pool, "a b")
    (slot,) = pool.slots_of(keys("a"))
    pool.remove(keys("a"))
    # store [c] -> takes a's freed slot, b stays
    plan = pool.prepare_store(keys("c"))
    assert plan.slots == ((ChunkKey("c"), slot),)
    assert plan.evicted == ()
    assert pool.usage().evictions == 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_removed_key_is_never_chosen_for_eviction(policy: str) -> None:
    pool = BlockPool(2, make_policy(policy, 2))
    store(pool, "a b")  # a is the least recently used
    pool.remove(keys("a"))
    # store [c, d] -> c takes the free slot, d evicts b: the policy no longer offers a
    plan = pool.prepare_store(keys("c d"))
    assert plan.evicted == tuple(keys("b"))
    pool.complete_store(keys("c d"), success=True)
    assert ready(pool, "a b c d") == ["c", "d"]


def test_reset_after_a_remove_reports_only_the_keys_left() -> None:
    pool = BlockPool(3)
    store(pool, "a b")
    pool.remove(keys("a"))
    pool.take_events()
    pool.reset()
    assert pool.take_events() == (PoolEvent(REMOVED, tuple(keys("b"))),)
    assert pool.usage().used == 0


def test_remove_without_events_still_removes() -> None:
    pool = BlockPool(2, record_events=False)
    store(pool, "a")
    assert pool.remove(keys("a")) == 1
    assert pool.lookup(keys("a")) == 0
    assert pool.take_events() == ()


@given(
    stored=st.sets(st.sampled_from("abcdef"), max_size=6),
    pinned=st.sets(st.sampled_from("abcdef"), max_size=6),
    removed=st.lists(st.sampled_from("abcdefgh"), max_size=8),
)
def test_remove_drops_exactly_the_ready_unpinned_keys_given(
    stored: set[str], pinned: set[str], removed: list[str]
) -> None:
    pool = BlockPool(6)
    store(pool, " ".join(sorted(stored)))
    held = sorted(stored & pinned)
    pool.pin([ChunkKey(name) for name in held])
    gone = set(removed) & stored - pinned
    assert pool.remove([ChunkKey(name) for name in removed]) == len(gone)
    assert set(ready(pool, "a b c d e f")) == stored - gone
    assert pool.usage().used == len(stored - gone)


# -- reset ---------------------------------------------------------------------------------------------


def test_reset_with_pins_and_stores_in_flight() -> None:
    pool = BlockPool(4)
    store(pool, "a b")
    pool.pin(keys("a"))  # a load reads a
    pool.prepare_store(keys("c"))  # a store writes c
    pool.take_events()
    pool.reset()
    # everything left the index; a's and c's slots stay reserved for the jobs in flight
    assert pool.take_events() == (PoolEvent(REMOVED, tuple(keys("a b"))),)
    assert pool.lookup(keys("a")) == 0
    assert pool.usage() == PoolUsage(capacity=4, used=2, ready=0, storing=1, pinned=1, evictions=0)
    # the store finishes after the reset: its slot is freed, c is not resurrected
    pool.complete_store(keys("c"), success=True)
    assert pool.lookup(keys("c")) == 0
    assert pool.take_events() == ()
    # a is still being read: it cannot be stored again until the load lets go
    assert pool.prepare_store(keys("a")).slots == ()
    pool.unpin(keys("a"))
    assert pool.usage() == PoolUsage(capacity=4, used=0, ready=0, storing=0, pinned=0, evictions=0)
    store(pool, "a c")
    assert pool.lookup(keys("a c")) == 2


def test_reset_then_a_failed_late_store_frees_its_slot_too() -> None:
    pool = BlockPool(1)
    pool.prepare_store(keys("a"))
    pool.reset()
    assert pool.prepare_store(keys("a")).slots == ()  # still in flight: not stored twice
    pool.complete_store(keys("a"), success=False)
    assert pool.usage().used == 0
    pool.complete_store(keys("a"), success=True)  # a duplicate completion: ignored
    assert pool.lookup(keys("a")) == 0
    assert pool.usage().used == 0


def test_reset_of_an_orphan_twice_keeps_it_reserved() -> None:
    pool = BlockPool(2)
    store(pool, "a")
    pool.pin(keys("a"))
    pool.reset()
    pool.reset()
    assert pool.usage().used == 1
    pool.complete_store(keys("a"), success=True)  # an orphan is not a store: ignored
    assert pool.usage().used == 1
    pool.unpin(keys("a"))
    assert pool.usage().used == 0


# -- policies through the pool -------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "survivors"), [("lru", []), ("arc", ["hot1", "hot2"])])
def test_a_scan_flushes_frequent_keys_under_lru_but_not_under_arc(policy: str, survivors: list[str]) -> None:
    pool = BlockPool(4, make_policy(policy, 4))
    store(pool, "hot1 hot2")
    pool.touch(keys("hot1 hot2"))  # used again: frequent
    for i in range(8):
        store(pool, f"scan{i}")  # one-time chunks, one at a time
    assert ready(pool, "hot1 hot2") == survivors


# -- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_slots", [-1, True])
def test_num_slots_must_be_a_non_negative_integer(num_slots: int) -> None:
    with pytest.raises(ConfigError) as info:
        BlockPool(num_slots)
    assert info.value.field == "num_slots"


def test_a_pool_of_no_slots_holds_nothing() -> None:
    pool = BlockPool(0)
    plan = pool.prepare_store(keys("a b"))
    assert plan.slots == ()
    pool.complete_store(keys("a b"), success=True)
    assert pool.lookup(keys("a")) == 0
    assert pool.usage().capacity == 0
    assert pool.take_events() == ()


def test_policy_must_start_empty() -> None:
    policy = LRUPolicy()
    policy.insert(keys("a"))
    with pytest.raises(ConfigError) as info:
        BlockPool(4, policy)
    assert info.value.field == "policy"


def test_dirty_chunks_are_served_never_evicted_and_written_back_least_recently_used_first() -> None:
    pool = BlockPool(3)
    pool.prepare_store(keys("a b c"))
    assert pool.complete_store(keys("a b c x"), success=True, dirty=True) == tuple(keys("a b c"))
    assert pool.lookup(keys("a b c")) == 3  # served like any chunk
    assert pool.prepare_store(keys("d")).slots == ()  # none may be evicted before it is written back
    pool.touch(keys("a"))  # used again: written back last
    pool.pin(keys("b"))
    pool.unpin(keys("b"))  # a load read it: used again, and still dirty
    usage = pool.usage()
    assert (usage.dirty, usage.evictable, usage.pinned) == (3, 0, 0)
    slots = dict(zip(keys("a b c"), pool.slots_of(keys("a b c")), strict=True))
    taken = pool.take_dirty(2)
    assert taken == ((ChunkKey("c"), slots[ChunkKey("c")]), (ChunkKey("a"), slots[ChunkKey("a")]))
    usage = pool.usage()
    assert (usage.dirty, usage.evictable, usage.pinned) == (1, 0, 2)  # pinned while written back
    assert pool.prepare_store(keys("d")).slots == ()
    pool.unpin(keys("c a"))  # written back: clean, evictable as just used
    plan = pool.prepare_store(keys("d"))
    assert plan.evicted == tuple(keys("c"))
    assert pool.lookup(keys("b")) == 1  # b is still dirty: kept
    assert pool.take_dirty(5) == ((ChunkKey("b"), slots[ChunkKey("b")]),)
    assert pool.take_dirty(5) == ()


def test_a_removed_or_reset_dirty_chunk_is_never_handed_out_for_write_back() -> None:
    pool = BlockPool(4)
    pool.prepare_store(keys("a b c"))
    pool.complete_store(keys("a b c"), success=True, dirty=True)
    assert pool.remove(keys("b")) == 1
    assert [key for key, _ in pool.take_dirty(1)] == keys("a")
    pool.reset()
    assert pool.take_dirty(4) == ()
    pool.unpin(keys("a"))  # the write-back of a chunk the reset dropped ends: its slot is freed
    assert pool.usage() == PoolUsage(capacity=4, used=0, ready=0, storing=0, pinned=0, evictions=0)
