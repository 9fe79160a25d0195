"""Eviction policies on their own: the order keys go in, ARC's adaptation and its bounded memory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcore.errors import ConfigError
from kvcore.ids import ChunkKey
from kvcore.pool.eviction import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy


def keys(*names: str) -> list[ChunkKey]:
    return [ChunkKey(name) for name in names]


def drain(policy: EvictionPolicy) -> list[ChunkKey]:
    return policy.evict(len(policy))


# -- LRU -----------------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_first() -> None:
    policy = LRUPolicy()
    policy.insert(keys("a", "b", "c"))
    policy.hit(keys("a"))
    # order b, c, a -> evict 2 takes [b, c]
    assert policy.evict(2) == keys("b", "c")
    assert len(policy) == 1
    assert drain(policy) == keys("a")


def test_lru_hit_ignores_keys_it_does_not_hold() -> None:
    policy = LRUPolicy()
    policy.insert(keys("a", "b"))
    policy.hit(keys("x", "a"))
    assert drain(policy) == keys("b", "a")


def test_lru_discarded_key_is_never_a_victim_until_readmitted_as_most_recent() -> None:
    policy = LRUPolicy()
    policy.insert(keys("a", "b", "c"))
    policy.discard(keys("a", "x"))  # x unknown: ignored
    assert len(policy) == 2
    policy.readmit(keys("a"))
    # a comes back as most recently used: b, c, a
    assert drain(policy) == keys("b", "c", "a")


def test_evict_returns_fewer_keys_when_fewer_are_held() -> None:
    policies: list[EvictionPolicy] = [LRUPolicy(), ARCPolicy(4)]
    for policy in policies:
        policy.insert(keys("a"))
        assert policy.evict(3) == keys("a")
        assert policy.evict(1) == []


# -- ARC -----------------------------------------------------------------------------------------------


def test_arc_evicts_keys_used_once_before_keys_used_again() -> None:
    policy = ARCPolicy(4)
    policy.insert(keys("a", "b", "c"))
    policy.hit(keys("a"))  # a moves to the frequency list T2
    # target 0: T1 (b, c) goes before T2 (a)
    assert drain(policy) == keys("b", "c", "a")


def test_arc_readmitted_key_counts_as_used_again() -> None:
    policy = ARCPolicy(4)
    policy.insert(keys("a", "b"))
    policy.discard(keys("a"))  # pinned for a load
    policy.insert(keys("c"))
    policy.readmit(keys("a"))  # the load used it: T2
    assert drain(policy) == keys("b", "c", "a")


def test_arc_scan_does_not_flush_frequent_keys() -> None:
    capacity = 4
    policy = ARCPolicy(capacity)
    policy.insert(keys("hot1", "hot2"))
    policy.hit(keys("hot1", "hot2"))
    for i in range(20):
        # a scan of one-time keys, evicting one key each to stay within capacity
        if len(policy) == capacity:
            assert policy.evict(1)[0].startswith("scan")
        policy.insert(keys(f"scan{i}"))
    assert set(drain(policy)) >= set(keys("hot1", "hot2"))


def test_arc_ghost_hit_in_b1_grows_the_recency_target() -> None:
    policy = ARCPolicy(4)
    policy.insert(keys("a", "b"))
    assert policy.evict(1) == keys("a")  # a becomes a ghost in B1
    policy.insert(keys("a"))  # stored again soon after: T1 was too small
    assert policy.target == 1
    # T1 = [b] is within its target now, so T2 = [a] gives the victim
    assert policy.evict(1) == keys("a")


def test_arc_ghost_hit_in_b2_shrinks_the_recency_target() -> None:
    policy = ARCPolicy(4)
    policy.insert(keys("a", "b"))
    policy.evict(1)
    policy.insert(keys("a"))  # B1 ghost hit: target 1
    policy.hit(keys("b"))  # b to T2 as well: T2 = a, b; T1 empty
    assert policy.evict(1) == keys("a")  # a goes to the ghost list B2
    policy.insert(keys("a"))  # B2 ghost hit: target shrinks back
    assert policy.target == 0


@given(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=300))
def test_arc_ghosts_stay_within_twice_the_capacity(stream: list[int]) -> None:
    capacity = 5
    policy = ARCPolicy(capacity)
    held: set[ChunkKey] = set()
    for number in stream:
        key = ChunkKey(f"k{number}")
        if key in held:
            policy.hit([key])
            continue
        if len(held) == capacity:
            held -= set(policy.evict(1))
        policy.insert([key])
        held.add(key)
        assert policy.ghosts <= 2 * capacity
        assert 0 <= policy.target <= capacity
    assert set(drain(policy)) == held


def test_clear_forgets_keys_and_ghosts() -> None:
    policy = ARCPolicy(2)
    policy.insert(keys("a", "b"))
    policy.evict(1)
    policy.clear()
    assert len(policy) == 0
    assert policy.ghosts == 0
    policy.insert(keys("a"))  # no ghost left: a plain new key, target unchanged
    assert policy.target == 0


# -- both: the policy holds exactly the keys it was given ------------------------------------------------

OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "hit", "discard", "readmit", "evict"]), st.integers(0, 7)),
    max_size=60,
)


@pytest.mark.parametrize("name", ["lru", "arc"])
@given(ops=OPS)
def test_policy_holds_exactly_the_evictable_keys(name: str, ops: list[tuple[str, int]]) -> None:
    policy = make_policy(name, 4)
    held: set[ChunkKey] = set()
    out: set[ChunkKey] = set()  # discarded, waiting to be readmitted
    for op, number in ops:
        key = ChunkKey(f"k{number}")
        if op == "insert" and key not in held | out:
            policy.insert([key])
            held.add(key)
        elif op == "hit":
            policy.hit([key])
        elif op == "discard" and key in held:
            policy.discard([key])
            held.remove(key)
            out.add(key)
        elif op == "readmit" and key in out:
            policy.readmit([key])
            out.remove(key)
            held.add(key)
        elif op == "evict":
            victims = policy.evict(number % 3)
            assert len(victims) == len(set(victims))
            assert set(victims) <= held
            held -= set(victims)
        assert len(policy) == len(held)
    assert set(drain(policy)) == held


# -- construction --------------------------------------------------------------------------------------


def test_make_policy_by_name() -> None:
    assert isinstance(make_policy("lru", 8), LRUPolicy)
    assert isinstance(make_policy("arc", 8), ARCPolicy)


def test_unknown_policy_names_the_eviction_field() -> None:
    with pytest.raises(ConfigError) as info:
        make_policy("fifo", 8)
    assert info.value.field == "eviction"
    assert info.value.value == "fifo"


@pytest.mark.parametrize("capacity", [0, -3])
def test_arc_needs_a_positive_capacity(capacity: int) -> None:
    with pytest.raises(ConfigError) as info:
        ARCPolicy(capacity)
    assert info.value.field == "capacity"
