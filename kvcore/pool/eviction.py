"""Eviction policies: which evictable chunk the block pool gives up first when it needs a slot.

A policy holds only the keys the pool may evict (ready and unpinned); the pool tells it when keys
arrive, are used, leave for a while (pinned) and come back. Every method costs O(1) per key and allocates
nothing per key beyond the entry of an ``OrderedDict``, whose C implementation keeps its own linked list:
it is the intrusive LRU list, ``move_to_end``/``popitem`` run at C speed. Methods take batches, so that
the pool makes one Python call per operation rather than one per key.

- ``LRUPolicy`` evicts the least recently used key.
- ``ARCPolicy`` (Megiddo and Modha's adaptive replacement cache) splits keys used once (T1) from keys
  used again (T2) and remembers recently evicted keys (ghost lists B1 and B2, bounded by the capacity)
  to adapt the share of T1; a scan of one-time keys cannot flush the keys used often.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from kvcore.errors import ConfigError
from kvcore.ids import ChunkKey

__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "make_policy"]


class EvictionPolicy(Protocol):
    """The order in which evictable keys go. Batched, so that the pool makes one call per operation, not
    one per key. The pool guarantees the preconditions; none is checked."""

    def insert(self, keys: Iterable[ChunkKey]) -> None:
        """Keys just stored became evictable, most recent last (their first use). None of them is held."""
        ...

    def hit(self, keys: Iterable[ChunkKey]) -> None:
        """Keys were used again, most recent last. Keys not held are ignored."""
        ...

    def discard(self, keys: Iterable[ChunkKey]) -> None:
        """Stop holding ``keys`` for now (pinned); keys not held are ignored. Leaves no trace of eviction."""
        ...

    def readmit(self, keys: Iterable[ChunkKey]) -> None:
        """Keys that ``discard`` took out are evictable again, most recent last; they were used meanwhile."""
        ...

    def evict(self, count: int) -> list[ChunkKey]:
        """Remove and return up to ``count`` keys, the first to go first; fewer when fewer are held."""
        ...

    def clear(self) -> None:
        """Forget every key, including any memory of past evictions."""
        ...

    def __len__(self) -> int:
        """How many keys are held (evictable)."""
        ...


class LRUPolicy:
    """Least recently used first."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, keys: Iterable[ChunkKey]) -> None:
        order = self._order
        for key in keys:
            order[key] = None

    def hit(self, keys: Iterable[ChunkKey]) -> None:
        order, move = self._order, self._order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def discard(self, keys: Iterable[ChunkKey]) -> None:
        pop = self._order.pop
        for key in keys:
            pop(key, None)

    readmit = insert

    def evict(self, count: int) -> list[ChunkKey]:
        order = self._order
        victims: list[ChunkKey] = []
        while count > 0 and order:
            victims.append(order.popitem(False)[0])
            count -= 1
        return victims

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy:
    """Adaptive replacement cache over at most ``capacity`` keys.

    Differs from the paper in one point: the pool evicts before it knows which keys will take the slots,
    so the tie rule that looks at the incoming key is left out.
    """

    __slots__ = ("_b1", "_b2", "_capacity", "_t1", "_t2", "_target")

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or capacity < 1:
            raise ConfigError("capacity", capacity, "an integer >= 1")
        self._capacity = capacity
        self._target = 0  # the paper's p: how many of the held keys T1 should have
        self._t1: OrderedDict[ChunkKey, None] = OrderedDict()  # used once
        self._t2: OrderedDict[ChunkKey, None] = OrderedDict()  # used again
        self._b1: OrderedDict[ChunkKey, None] = OrderedDict()  # ghosts of T1
        self._b2: OrderedDict[ChunkKey, None] = OrderedDict()  # ghosts of T2

    @property
    def target(self) -> int:
        """How many held keys the recency list T1 aims at (grows on B1 ghost hits, shrinks on B2's)."""
        return self._target

    @property
    def ghosts(self) -> int:
        """How many evicted keys are remembered (at most twice the capacity)."""
        return len(self._b1) + len(self._b2)

    def insert(self, keys: Iterable[ChunkKey]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in keys:
            if key in b1:
                # evicted from T1 too early: give T1 more room
                self._target = min(self._capacity, self._target + max(1, len(b2) // len(b1)))
                del b1[key]
                t2[key] = None
            elif key in b2:
                self._target = max(0, self._target - max(1, len(b1) // len(b2)))
                del b2[key]
                t2[key] = None
            else:
                t1[key] = None

    def hit(self, keys: Iterable[ChunkKey]) -> None:
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t1:
                del t1[key]
                t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def discard(self, keys: Iterable[ChunkKey]) -> None:
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t1:
                del t1[key]
            else:
                t2.pop(key, None)

    def readmit(self, keys: Iterable[ChunkKey]) -> None:
        t2 = self._t2
        for key in keys:
            t2[key] = None

    def evict(self, count: int) -> list[ChunkKey]:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        target, capacity = self._target, self._capacity
        victims: list[ChunkKey] = []
        while count > 0 and (t1 or t2):
            if t1 and (len(t1) > target or not t2):
                key = t1.popitem(False)[0]
                b1[key] = None
            else:
                key = t2.popitem(False)[0]
                b2[key] = None
            victims.append(key)
            count -= 1
        # The paper's bounds on ghosts: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.
        while b1 and len(t1) + len(b1) > capacity:
            b1.popitem(False)
        while b2 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * capacity:
            b2.popitem(False)
        return victims

    def clear(self) -> None:
        for keys in (self._t1, self._t2, self._b1, self._b2):
            keys.clear()
        self._target = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` ("lru" or "arc") for a pool of ``capacity`` slots."""
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    raise ConfigError("eviction", name, 'one of "lru", "arc"')
