"""The block pool: the scheduler-side index of host slots (the CPU tier), one chunk of one shard a slot.

Primitives, and who calls them (the scheduler side of a connector; workers own the bytes):

- ``lookup`` / ``touch`` — how many leading chunks are ready, and mark them used (prefix hits).
- ``prepare_store`` -> copy -> ``complete_store(success)`` — two-phase store. A chunk being stored is
  invisible to ``lookup`` and never evicted; a failed store gives its slot back.
- ``pin`` / ``unpin`` — hold ready chunks while a load reads their slots; pinned chunks are never evicted.
- ``reset`` — drop everything, correct with jobs in flight: nothing in flight loses its slot, nothing
  in flight comes back.
- ``take_events`` — STORED / REMOVED events, for KV-event subscribers.

Eviction takes unpinned ready chunks in the order of an ``EvictionPolicy`` (LRU by default).

Every operation costs O(1) per block and allocates no Python object per block beyond dict entries: slot
numbers live in a free list of ints (sliced off and put back in bulk), one plain dict maps each key to
its slot (negative while not ready), recency is an ``OrderedDict`` inside the policy, and per-key work
runs in comprehensions and C-level bulk calls (``dict.update``, ``zip``) rather than in method calls per
key. What is allocated is per call: the returned tuples and one event. The exception is
``StorePlan.slots``, whose (key, slot) pairs the API asks for.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence

from attrs import frozen

from kvcore.errors import ConfigError, InvalidSpecError
from kvcore.eviction import EvictionPolicy, LRUPolicy
from kvcore.ids import ChunkKey

__all__ = ["BlockPool", "PoolEvent", "PoolEventKind", "PoolUsage", "StorePlan"]


class PoolEventKind(enum.Enum):
    """What happened to the keys of a ``PoolEvent``."""

    STORED = "stored"  # became ready: lookups find them
    REMOVED = "removed"  # left the index: evicted or reset


@frozen
class PoolEvent:
    """Keys that became ready, or left the index, in one operation."""

    kind: PoolEventKind
    keys: tuple[ChunkKey, ...]


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
    entries, those included."""

    capacity: int
    used: int
    ready: int
    storing: int
    pinned: int
    evictions: int


class BlockPool:
    """Index of ``num_slots`` host slots, evicting unpinned ready chunks in ``policy`` order."""

    def __init__(self, num_slots: int, policy: EvictionPolicy | None = None) -> None:
        if isinstance(num_slots, bool) or num_slots < 1:
            raise ConfigError("num_slots", num_slots, "an integer >= 1")
        if policy is None:
            policy = LRUPolicy()
        elif len(policy) != 0:
            raise ConfigError("policy", policy, "an eviction policy that holds no key yet")
        self._capacity = num_slots
        self._policy = policy
        # A stack: the lowest slots are handed out first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        # Every key that holds a slot: a ready key maps to its slot, any other (being stored, or left
        # behind by reset) to ~slot, a negative number. One dict answers both "is it ready" (lookups)
        # and "is it known" (stores) with a single probe.
        self._slots: dict[ChunkKey, int] = {}
        self._storing = 0
        self._pins: dict[ChunkKey, int] = {}
        # Left behind by reset: stores whose completion must free the slot, and pinned entries whose last
        # unpin frees it (key -> slot). Their keys stay in ``_slots`` until then, unavailable, so that a
        # late completion or unpin can never be taken for one of a new entry with the same key.
        self._doomed: dict[ChunkKey, int] = {}
        self._orphans: dict[ChunkKey, int] = {}
        self._events: list[PoolEvent] = []
        self._evictions = 0

    # -- lookups ---------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` are ready. Changes nothing (see ``touch``)."""
        get = self._slots.get
        count = 0
        for key in keys:
            if get(key, -1) < 0:
                break
            count += 1
        return count

    def slots_of(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """The slots of ready ``keys``, in order. Raises ``InvalidSpecError`` if one is not ready."""
        get = self._slots.get
        slots = tuple([get(key, -1) for key in keys])
        if slots and min(slots) < 0:
            missing = keys[slots.index(min(slots))]
            raise InvalidSpecError(f"chunk {missing!r} is not ready in the block pool")
        return slots

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark ready ``keys`` as just used. Keys that are not ready are ignored, and so are pinned keys:
        their last unpin makes them most recently used."""
        self._policy.hit(keys)

    # -- two-phase store -------------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[ChunkKey]) -> StorePlan:
        """Reserve slots for the ``keys`` that are neither ready nor being stored.

        Takes free slots first, then evicts unpinned ready chunks in policy order, never one of ``keys``.
        Stops at the first new key that finds no slot: a chunk stored after a gap is no use to a prefix
        lookup. The reserved keys stay invisible until ``complete_store``.
        """
        slots, free = self._slots, self._free
        new = dict.fromkeys([key for key in keys if key not in slots])
        cut = max(0, len(free) - len(new))
        taken = free[cut:]
        del free[cut:]
        taken.reverse()
        evicted: list[ChunkKey] = []
        if len(taken) < len(new):
            shielded = self._shield(keys)
            evicted = self._policy.evict(len(new) - len(taken))
            self._policy.readmit(shielded)
            taken.extend([slots.pop(key) for key in evicted])
        reserved = tuple(zip(new, taken, strict=False))  # the keys beyond the last slot get none
        slots.update(zip(new, map(operator.invert, taken), strict=False))
        self._storing += len(reserved)
        gone = tuple(evicted)
        if gone:
            self._evictions += len(gone)
            self._events.append(PoolEvent(PoolEventKind.REMOVED, gone))
        return StorePlan(slots=reserved, evicted=gone, skipped=len(keys) - len(new))

    def complete_store(self, keys: Sequence[ChunkKey], success: bool) -> None:
        """Finish the stores of ``keys``: on success they become ready (most recently used), on failure
        their slots are freed. Keys not being stored are ignored, so a second call changes nothing."""
        slots, get = self._slots, self._slots.get
        limbo = bool(self._doomed or self._orphans)
        done: list[ChunkKey] = []
        for key in keys:
            slot = get(key, 0)
            if slot >= 0 or (limbo and self._settle(key)):
                continue
            if success:
                slots[key] = ~slot
            else:
                del slots[key]
                self._free.append(~slot)
            done.append(key)
        self._storing -= len(done)
        if done and success:
            self._policy.insert(done)
            self._events.append(PoolEvent(PoolEventKind.STORED, tuple(done)))

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
                continue
            del pins[key]
            orphan = self._orphans.pop(key, None)
            if orphan is None:
                released.append(key)
            else:
                del self._slots[key]
                self._free.append(orphan)
        self._policy.readmit(released)

    # -- whole pool ------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every chunk, with jobs in flight.

        Ready chunks leave the index now (one REMOVED event); the slots of unpinned ones are free at once,
        pinned ones keep theirs until their last unpin. Stores in progress are doomed: their completion
        frees the slot, whatever its outcome, and never publishes the key.
        """
        pins, doomed, orphans = self._pins, self._doomed, self._orphans
        kept: dict[ChunkKey, int] = {}
        removed: list[ChunkKey] = []
        for key, slot in self._slots.items():
            if slot < 0:
                if key not in doomed and key not in orphans:
                    doomed[key] = ~slot
                kept[key] = slot
                continue
            removed.append(key)
            if key in pins:
                orphans[key] = slot
                kept[key] = ~slot
            else:
                self._free.append(slot)
        self._slots = kept
        self._storing = 0
        self._policy.clear()
        if removed:
            self._events.append(PoolEvent(PoolEventKind.REMOVED, tuple(removed)))

    def take_events(self) -> tuple[PoolEvent, ...]:
        """The events since the last call, oldest first."""
        events = tuple(self._events)
        self._events.clear()
        return events

    def usage(self) -> PoolUsage:
        """Slot accounting now; see ``PoolUsage``."""
        doomed, orphans = len(self._doomed), len(self._orphans)
        return PoolUsage(
            capacity=self._capacity,
            used=self._capacity - len(self._free),
            ready=len(self._slots) - self._storing - doomed - orphans,
            storing=self._storing + doomed,
            pinned=len(self._pins),
            evictions=self._evictions,
        )

    # -- helpers ---------------------------------------------------------------------------------------

    def _settle(self, key: ChunkKey) -> bool:
        """Whether ``key`` is one that reset left behind (then a completion is no completion); a doomed
        store gives its slot back."""
        slot = self._doomed.pop(key, None)
        if slot is None:
            return key in self._orphans
        del self._slots[key]
        self._free.append(slot)
        return True

    def _shield(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Take the evictable ones among ``keys`` out of the policy, so that a store never evicts a chunk
        of its own prefix; the caller readmits them."""
        get, pins = self._slots.get, self._pins
        shielded = list(dict.fromkeys([key for key in keys if get(key, -1) >= 0 and key not in pins]))
        self._policy.discard(shielded)
        return shielded
