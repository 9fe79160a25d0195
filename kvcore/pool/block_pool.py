"""The block pool: the scheduler-side index of host slots (the CPU tier), one chunk of one shard a slot.

Primitives, and who calls them (the scheduler side of a connector; workers own the bytes):

- ``lookup`` / ``touch`` — how many leading chunks are ready, and mark them used (prefix hits).
- ``prepare_store`` -> copy -> ``complete_store(success)`` — two-phase store. A chunk being stored is
  invisible to ``lookup`` and never evicted; a failed store gives its slot back.
- ``pin`` / ``unpin`` — hold ready chunks while a load reads their slots; pinned chunks are never evicted.
- ``remove`` — drop ready, unpinned chunks now: a chunk whose checksum did not match, an operator action.
- ``complete_store(dirty=True)`` -> ``take_dirty`` -> copy -> ``unpin`` — write-back: a *dirty* chunk
  (stored here, not yet in a lower tier written back) is served but never evicted; ``take_dirty`` hands
  out the least recently used ones, pinned while a copy reads them, and their unpin makes them clean.
- ``reset`` — drop everything, correct with jobs in flight: nothing in flight loses its slot, nothing
  in flight comes back.
- ``take_events`` — STORED / REMOVED events, for KV-event subscribers.

Eviction takes unpinned ready chunks in the order of an ``EvictionPolicy`` (LRU by default).

Every operation costs O(1) per block and allocates no Python object per block beyond dict entries (and
the (key, slot) pairs of ``StorePlan.slots``, which the API asks for): slot numbers live in a free list
of ints used as a stack, plain dicts map keys to their slots (one for ready keys, one for the others),
recency is an ``OrderedDict`` inside the policy, whose C linked list is the intrusive LRU list. Each call
makes one call into the policy, not one per key, and the loops use no helper calls or iterator objects:
at one block per call, the fixed cost of a call is what counts. What is allocated is per call: the
returned tuples and at most one event.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence

from attrs import frozen

from kvcore.errors import ConfigError, InvalidSpecError
from kvcore.ids import ChunkKey
from kvcore.pool.eviction import EvictionPolicy, LRUPolicy

__all__ = ["BlockPool", "PoolEvent", "PoolEventKind", "PoolUsage", "StorePlan"]


class PoolEventKind(enum.Enum):
    """What happened to the keys of a ``PoolEvent``."""

    STORED = "stored"  # became ready: lookups find them
    REMOVED = "removed"  # left the index: evicted, removed or reset


@frozen
class PoolEvent:
    """Keys that became ready, or left the index, in one operation.

    ``tier``: 0 for the pool's own events; ``n`` for the scheduler's word that the ``n``-th remote tier
    behind the pool (1: the first) now holds every shard of the keys (``CacheScheduler.take_events``).
    """

    kind: PoolEventKind
    keys: tuple[ChunkKey, ...]
    tier: int = 0


@frozen
class StorePlan:
    """What ``prepare_store`` reserved: copy each key's chunk into its slot, then call ``complete_store``.

    ``slots`` covers the longest leading run of new keys that fits (possibly none); ``evicted`` lists the
    ready keys given up for it; ``skipped`` counts the given keys that were already ready or in progress.
    """

    slots: tuple[tuple[ChunkKey, int], ...]
    evicted: tuple[ChunkKey, ...]
    skipped: int


@frozen
class PoolUsage:
    """Slot accounting. ``used`` counts slots not free: ``ready + storing`` plus pinned slots that
    ``reset`` took out of the index and that wait for their last unpin. ``pinned`` counts pinned
    entries, those included. ``dirty``: ready chunks not yet written back (never evicted);
    ``evictable``: ready chunks an eviction may take now (neither pinned nor dirty)."""

    capacity: int
    used: int
    ready: int
    storing: int
    pinned: int
    evictions: int
    dirty: int = 0
    evictable: int = 0


class _FreeSlots:
    """The free slots: those given back (taken first, last in first out), then those never used, in
    order, so that a batch of keys gets consecutive slots while the pool fills up. Costs nothing per slot
    until a slot is used: a pool's size may be anything the host could hold (a list of every slot number
    took gigabytes for a large one)."""

    __slots__ = ("_capacity", "_given_back", "_next")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._given_back: list[int] = []
        self._next = 0  # the first slot never used

    def __len__(self) -> int:
        return len(self._given_back) + self._capacity - self._next

    def pop(self) -> int:
        if self._given_back:
            return self._given_back.pop()
        if self._next >= self._capacity:
            raise IndexError("no free slot")
        self._next += 1
        return self._next - 1

    def append(self, slot: int) -> None:
        self._given_back.append(slot)


class BlockPool:
    """Index of ``num_slots`` host slots, evicting unpinned ready chunks in ``policy`` order.

    A pool of no slots holds nothing: it is the index of a scheduler whose remote tier moves every chunk
    straight to and from the engine.

    ``record_events=False`` skips building events for a caller that publishes none (``take_events``
    then returns nothing).
    """

    def __init__(
        self, num_slots: int, policy: EvictionPolicy | None = None, *, record_events: bool = True
    ) -> None:
        if isinstance(num_slots, bool) or num_slots < 0:
            raise ConfigError("num_slots", num_slots, "an integer >= 0")
        if policy is None:
            policy = LRUPolicy()
        elif len(policy) != 0:
            raise ConfigError("policy", policy, "an eviction policy that holds no key yet")
        self._capacity = num_slots
        self._policy = policy
        self._free = _FreeSlots(num_slots)
        self._ready: dict[ChunkKey, int] = {}
        # Keys that hold a slot but are not ready: being stored, or left behind by reset (below).
        self._pending: dict[ChunkKey, int] = {}
        self._pins: dict[ChunkKey, int] = {}
        # Left behind by reset, and still in ``_pending``: stores whose completion must free the slot, and
        # pinned entries whose last unpin frees it. Their keys stay unavailable until then, so that a
        # late completion or unpin can never be taken for one of a new entry with the same key.
        self._doomed: set[ChunkKey] = set()
        self._orphans: set[ChunkKey] = set()
        self._events: list[PoolEvent] | None = [] if record_events else None
        self._evictions = 0
        # Ready chunks not yet written back, least recently used first; never in the policy.
        self._dirty: OrderedDict[ChunkKey, None] = OrderedDict()

    # -- lookups ---------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` are ready. Changes nothing (see ``touch``)."""
        ready = self._ready
        count = 0
        for key in keys:
            if key not in ready:
                break
            count += 1
        return count

    def slots_of(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """The slots of ready ``keys``, in order. Raises ``InvalidSpecError`` if one is not ready."""
        ready = self._ready
        try:
            return tuple([ready[key] for key in keys])
        except KeyError as exc:
            raise InvalidSpecError(f"chunk {exc.args[0]!r} is not ready in the block pool") from None

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark ready ``keys`` as just used. Keys that are not ready are ignored, and so are pinned keys:
        their last unpin makes them most recently used."""
        self._policy.hit(keys)
        if self._dirty:
            self._used_dirty(keys)

    # -- two-phase store -------------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[ChunkKey]) -> StorePlan:
        """Reserve slots for the ``keys`` that are neither ready nor being stored.

        Takes free slots first, then evicts unpinned ready chunks in policy order, never one of ``keys``.
        Stops at the first new key that finds no slot: a chunk stored after a gap is no use to a prefix
        lookup. The reserved keys stay invisible until ``complete_store``.
        """
        ready, pending, free = self._ready, self._pending, self._free
        new: list[ChunkKey] = []
        for key in keys:
            if key not in ready and key not in pending:
                new.append(key)
        if len(new) > 1 and len(set(new)) < len(new):
            new = list(dict.fromkeys(new))  # a key given twice is stored once
        evicted: tuple[ChunkKey, ...] = ()
        if len(new) > len(free):
            # keys that are not new may be ready: keep them
            evicted = self._evict(len(new) - len(free), keys if len(new) < len(keys) else ())
        reserved: list[tuple[ChunkKey, int]] = []
        for key in new:
            if not free:
                break  # the keys beyond the last slot get none
            slot = free.pop()
            pending[key] = slot
            reserved.append((key, slot))
        return StorePlan(tuple(reserved), evicted, len(keys) - len(new))

    def complete_store(
        self, keys: Sequence[ChunkKey], success: bool, *, dirty: bool = False
    ) -> tuple[ChunkKey, ...]:
        """Finish the stores of ``keys``: on success they become ready (most recently used), on failure
        their slots are freed; returns the keys that became ready. Keys not being stored are ignored, so
        a second call changes nothing.

        ``dirty``: the chunks must still be written back to a lower tier; they are never evicted until
        ``take_dirty`` handed them out and their pin is released."""
        if self._doomed or self._orphans:
            keys = [key for key in keys if not self._settle(key)]
        pop = self._pending.pop
        if not success:
            free = self._free
            for key in keys:
                slot = pop(key, -1)
                if slot >= 0:
                    free.append(slot)
            return ()
        ready = self._ready
        done: list[ChunkKey] = []
        for key in keys:
            slot = pop(key, -1)
            if slot >= 0:
                ready[key] = slot
                done.append(key)
        if done:
            self._policy.insert(done)
            if dirty:  # held out of the policy as a pin holds a key (ARC still learns from its ghosts)
                self._policy.discard(done)
                self._dirty.update(dict.fromkeys(done))
            if self._events is not None:
                self._events.append(PoolEvent(PoolEventKind.STORED, tuple(done)))
        return tuple(done)

    # -- pins ------------------------------------------------------------------------------------------

    def pin(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """Hold ready ``keys`` for a load in flight; returns their slots. Pins nest (a count per key).

        Raises ``InvalidSpecError`` if a key is not ready; then nothing is pinned.
        """
        slots = self.slots_of(keys)
        pins = self._pins
        self._policy.discard([key for key in keys if key not in pins])
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        return slots

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Release one pin of each key. A key left without pins is evictable again, as most recently
        used; one that ``reset`` took out of the index gives its slot back instead.

        Raises ``InvalidSpecError`` if a key holds fewer pins than it appears in ``keys``; then nothing
        is unpinned.
        """
        pins = self._pins
        for key in keys:
            if key not in pins:
                raise InvalidSpecError(f"chunk {key!r} is not pinned")
        if len(keys) > 1 and len(set(keys)) < len(keys):
            for key in set(keys):
                if keys.count(key) > pins[key]:
                    raise InvalidSpecError(f"chunk {key!r} is unpinned more times than it is pinned")
        released: list[ChunkKey] = []
        for key in keys:
            count = pins[key] - 1
            if count:
                pins[key] = count
            elif key in self._orphans:
                del pins[key]
                self._orphans.discard(key)
                self._free.append(self._pending.pop(key))
            else:
                del pins[key]
                released.append(key)
        if self._dirty:
            released = self._used_dirty(released)
        self._policy.readmit(released)

    # -- write-back ------------------------------------------------------------------------------------

    def take_dirty(self, count: int) -> tuple[tuple[ChunkKey, int], ...]:
        """Up to ``count`` dirty chunks, least recently used first, with their slots: no longer dirty,
        and pinned while the caller copies them to the lower tier; ``unpin`` then makes them evictable
        (most recently used), whatever the copy's outcome."""
        dirty, pins, ready = self._dirty, self._pins, self._ready
        taken: list[tuple[ChunkKey, int]] = []
        while dirty and len(taken) < count:
            key, _ = dirty.popitem(last=False)
            pins[key] = pins.get(key, 0) + 1
            taken.append((key, ready[key]))
        return tuple(taken)

    # -- removal ---------------------------------------------------------------------------------------

    def remove(self, keys: Sequence[ChunkKey]) -> int:
        """Drop the ready, unpinned ``keys`` now and free their slots; returns how many were dropped.

        For chunks that must never be served again (bytes that failed their checksum) and for operators.
        Keys that are pinned (a load reads them), being stored or absent are left as they are: the caller
        removes a pinned key again after its unpin. A removal is not an eviction: ``usage().evictions``
        does not count it, and the policy keeps no memory of the key.
        """
        ready, pins, free = self._ready, self._pins, self._free
        removed: list[ChunkKey] = []
        for key in keys:
            if key in pins:
                continue
            slot = ready.pop(key, -1)
            if slot >= 0:
                free.append(slot)
                removed.append(key)
        if removed:
            self._policy.discard(removed)
            if self._dirty:
                for key in removed:
                    self._dirty.pop(key, None)
            if self._events is not None:
                self._events.append(PoolEvent(PoolEventKind.REMOVED, tuple(removed)))
        return len(removed)

    # -- whole pool ------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every chunk, with jobs in flight.

        Ready chunks leave the index now (one REMOVED event); the slots of unpinned ones are free at once,
        pinned ones keep theirs until their last unpin. Stores in progress are doomed: their completion
        frees the slot, whatever its outcome, and never publishes the key.
        """
        self._doomed.update(self._pending.keys() - self._orphans)
        pins, pending = self._pins, self._pending
        for key, slot in self._ready.items():
            if key in pins:
                self._orphans.add(key)
                pending[key] = slot
            else:
                self._free.append(slot)
        if self._ready and self._events is not None:
            self._events.append(PoolEvent(PoolEventKind.REMOVED, tuple(self._ready)))
        self._ready.clear()
        self._dirty.clear()
        self._policy.clear()

    def take_events(self) -> tuple[PoolEvent, ...]:
        """The events since the last call, oldest first."""
        if not self._events:
            return ()
        events = tuple(self._events)
        self._events.clear()
        return events

    def usage(self) -> PoolUsage:
        """Slot accounting now; see ``PoolUsage``."""
        return PoolUsage(
            capacity=self._capacity,
            used=self._capacity - len(self._free),
            ready=len(self._ready),
            storing=len(self._pending) - len(self._orphans),
            pinned=len(self._pins),
            evictions=self._evictions,
            dirty=len(self._dirty),
            evictable=len(self._policy),
        )

    # -- helpers ---------------------------------------------------------------------------------------

    def _evict(self, count: int, keep: Sequence[ChunkKey]) -> tuple[ChunkKey, ...]:
        """Evict up to ``count`` chunks, none of ``keep``, and put their slots on the free list."""
        policy, ready = self._policy, self._ready
        if keep:
            # Out of the policy while it picks: a store never evicts a chunk of its own prefix.
            pins, dirty = self._pins, self._dirty
            shielded = list(
                dict.fromkeys([key for key in keep if key in ready and key not in pins and key not in dirty])
            )
            policy.discard(shielded)
            victims = policy.evict(count)
            policy.readmit(shielded)
        else:
            victims = policy.evict(count)
        free = self._free
        for key in victims:
            free.append(ready.pop(key))
        evicted = tuple(victims)
        self._evictions += len(evicted)
        if evicted and self._events is not None:
            self._events.append(PoolEvent(PoolEventKind.REMOVED, evicted))
        return evicted

    def _used_dirty(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Make the dirty ones of ``keys`` the most recently used dirty chunks; the others, in order."""
        dirty = self._dirty
        clean: list[ChunkKey] = []
        for key in keys:
            if key in dirty:
                dirty.move_to_end(key)
            else:
                clean.append(key)
        return clean

    def _settle(self, key: ChunkKey) -> bool:
        """Whether ``key`` is one that reset left behind (then a completion is no completion); a doomed
        store gives its slot back."""
        if key in self._doomed:
            self._doomed.discard(key)
            self._free.append(self._pending.pop(key))
            return True
        return key in self._orphans
