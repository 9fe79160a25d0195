"""The block pool against a model made of plain dicts, under random interleavings of every operation.

Checked after every step, for both eviction policies: no pinned, storing or dirty slot is ever evicted,
no two keys share a slot, used <= capacity, the usage figures and lookups match the model, the events
replay to exactly the ready keys, dirty chunks are handed out for write-back least recently used first,
and a reset in mid-flight followed by late completions never resurrects a key. At the end, every store in
flight is completed, every dirty chunk written back and every pin released: the figures must add up.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey
from kvcore.pool.block_pool import BlockPool, PoolEventKind, PoolUsage
from kvcore.pool.eviction import make_policy

CAPACITY = 3
KEYS = [ChunkKey(f"k{i}") for i in range(6)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=4)


class PoolMachine(RuleBasedStateMachine):
    policy: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(CAPACITY, make_policy(self.policy, CAPACITY))
        # the model: key -> slot for each state a slot can be in, and pin counts
        self.ready: dict[ChunkKey, int] = {}
        self.storing: dict[ChunkKey, int] = {}
        self.doomed: dict[ChunkKey, int] = {}  # stores in flight at a reset
        self.orphans: dict[ChunkKey, int] = {}  # pinned at a reset
        self.pins: Counter[ChunkKey] = Counter()
        self.dirty: list[ChunkKey] = []  # ready, not yet written back: least recently used first
        self.evictions = 0
        self.published: set[ChunkKey] = set()  # what the events say is ready

    def held(self) -> dict[ChunkKey, int]:
        return self.ready | self.storing | self.doomed | self.orphans

    # -- rules ---------------------------------------------------------------------------------------

    @rule(keys=key_lists)
    def prepare(self, keys: list[ChunkKey]) -> None:
        held = self.held()
        new = list(dict.fromkeys(key for key in keys if key not in held))
        free = CAPACITY - len(held)
        evictable = [
            key for key in self.ready if key not in self.pins and key not in keys and key not in self.dirty
        ]
        fits = min(len(new), free + len(evictable))

        plan = self.pool.prepare_store(keys)

        assert [key for key, _ in plan.slots] == new[:fits]  # the leading run that fits
        assert plan.skipped == len(keys) - len(new)
        assert len(plan.evicted) == max(0, fits - free)  # free slots first
        for key in plan.evicted:
            assert key in evictable  # never pinned, storing, or one of the keys being stored
            del self.ready[key]
        self.evictions += len(plan.evicted)
        self.storing.update(plan.slots)

    @rule(data=st.data(), success=st.booleans(), dirty=st.booleans())
    def complete(self, data: st.DataObject, success: bool, dirty: bool) -> None:
        candidates = sorted(self.storing.keys() | self.doomed.keys()) + KEYS
        keys = data.draw(st.lists(st.sampled_from(candidates), max_size=4))
        became_ready = self.pool.complete_store(keys, success, dirty=dirty)
        stored = []
        for key in keys:
            if key in self.doomed:
                del self.doomed[key]  # freed, whatever the outcome: never published
            elif key in self.storing:
                slot = self.storing.pop(key)
                if success:
                    self.ready[key] = slot
                    stored.append(key)
        assert became_ready == tuple(stored)
        if dirty:
            self.dirty.extend(stored)

    @rule(keys=key_lists)
    def touch(self, keys: list[ChunkKey]) -> None:
        self.pool.touch(keys)
        self.used_dirty(keys)

    def used_dirty(self, keys: list[ChunkKey]) -> None:
        for key in keys:
            if key in self.dirty:
                self.dirty.remove(key)
                self.dirty.append(key)

    @rule(count=st.integers(0, CAPACITY + 1))
    def take_dirty(self, count: int) -> None:
        taken, self.dirty = self.dirty[:count], self.dirty[count:]
        assert self.pool.take_dirty(count) == tuple((key, self.ready[key]) for key in taken)
        self.pins.update(taken)  # pinned while written back; the unpin makes them clean

    @rule(keys=key_lists)
    def remove(self, keys: list[ChunkKey]) -> None:
        gone = [key for key in dict.fromkeys(keys) if key in self.ready and key not in self.pins]
        assert self.pool.remove(keys) == len(gone)
        for key in gone:
            del self.ready[key]
            if key in self.dirty:
                self.dirty.remove(key)

    @rule(keys=key_lists)
    def lookup(self, keys: list[ChunkKey]) -> None:
        leading = 0
        while leading < len(keys) and keys[leading] in self.ready:
            leading += 1
        assert self.pool.lookup(keys) == leading

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def pin_ready(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        assert self.pool.pin(keys) == tuple(self.ready[key] for key in keys)
        self.pins.update(keys)

    @rule(keys=key_lists)
    def pin(self, keys: list[ChunkKey]) -> None:
        if all(key in self.ready for key in keys):
            assert self.pool.pin(keys) == tuple(self.ready[key] for key in keys)
            self.pins.update(keys)
        else:
            with pytest.raises(InvalidSpecError):
                self.pool.pin(keys)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin_pinned(self, data: st.DataObject) -> None:
        self.unpin(data.draw(st.lists(st.sampled_from(sorted(self.pins)), min_size=1, max_size=3)))

    @rule(keys=key_lists)
    def unpin(self, keys: list[ChunkKey]) -> None:
        if any(self.pins[key] < count for key, count in Counter(keys).items()):
            with pytest.raises(InvalidSpecError):
                self.pool.unpin(keys)
            return
        self.pool.unpin(keys)
        self.pins.subtract(keys)
        released = []
        for key in keys:
            if self.pins[key] == 0:
                del self.pins[key]
                if self.orphans.pop(key, None) is None:
                    released.append(key)
        self.used_dirty(released)

    @rule()
    def reset(self) -> None:
        self.pool.reset()
        self.orphans.update({key: slot for key, slot in self.ready.items() if key in self.pins})
        self.ready.clear()
        self.dirty.clear()
        self.doomed.update(self.storing)
        self.storing.clear()

    # -- invariants ----------------------------------------------------------------------------------

    @invariant()
    def slots_are_exclusive_and_counted(self) -> None:
        slots = [
            *self.ready.values(),
            *self.storing.values(),
            *self.doomed.values(),
            *self.orphans.values(),
        ]
        assert len(slots) == len(set(slots))
        assert all(0 <= slot < CAPACITY for slot in slots)
        assert self.pool.usage() == PoolUsage(
            capacity=CAPACITY,
            used=len(slots),
            ready=len(self.ready),
            storing=len(self.storing) + len(self.doomed),
            pinned=len(self.pins),
            evictions=self.evictions,
            dirty=len(self.dirty),
            evictable=sum(1 for key in self.ready if key not in self.pins and key not in self.dirty),
        )

    @invariant()
    def exactly_the_model_keys_are_ready(self) -> None:
        assert [key for key in KEYS if self.pool.lookup([key])] == [key for key in KEYS if key in self.ready]
        assert self.pool.slots_of(list(self.ready)) == tuple(self.ready.values())

    @invariant()
    def events_replay_to_the_ready_keys(self) -> None:
        for event in self.pool.take_events():
            if event.kind is PoolEventKind.STORED:
                assert self.published.isdisjoint(event.keys)
                self.published.update(event.keys)
            else:
                assert self.published.issuperset(event.keys)
                self.published.difference_update(event.keys)
        assert self.published == set(self.ready)

    def teardown(self) -> None:
        # every job in flight ends, every load lets go: all that is left is ready and evictable
        self.pool.complete_store([*self.storing, *self.doomed], success=True)
        for key, count in self.pins.items():
            self.pool.unpin([key] * count)
            if key not in self.orphans:
                self.used_dirty([key])
        written = self.pool.take_dirty(CAPACITY)  # the dirty chunks written back, then clean
        assert [key for key, _ in written] == self.dirty
        self.pool.unpin([key for key, _ in written])
        ready = self.ready | self.storing
        usage = self.pool.usage()
        assert usage.storing == usage.pinned == 0
        assert usage.used == usage.ready == len(ready)
        # nothing is stuck: fresh keys take every slot, evicting exactly what was ready
        fresh = [ChunkKey(f"fresh{i}") for i in range(CAPACITY)]
        plan = self.pool.prepare_store(fresh)
        assert len(plan.slots) == CAPACITY
        assert sorted(plan.evicted) == sorted(ready)
        # and a reset before those stores complete leaves nothing behind
        self.pool.reset()
        self.pool.complete_store(fresh, success=True)
        assert self.pool.lookup(fresh[:1]) == 0
        assert self.pool.usage().used == 0


@settings(max_examples=60, stateful_step_count=30, deadline=None)
class LRUPoolMachine(PoolMachine):
    policy = "lru"


@settings(max_examples=60, stateful_step_count=30, deadline=None)
class ARCPoolMachine(PoolMachine):
    policy = "arc"


TestLRUPool = LRUPoolMachine.TestCase
TestARCPool = ARCPoolMachine.TestCase
