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
numbers live in a free list of ints (``list.pop``/``append``), keys map to their slot in plain dicts,
recency is an ``OrderedDict`` inside the policy. What is allocated is per call: the returned tuples and
one event per call. The one exception is ``StorePlan.slots``, whose (key, slot) pairs the API asks for.
"""

from __future__ import annotations

import enum
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
        # Popped from the end: the lowest slots are handed out first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._ready: dict[ChunkKey, int] = {}
        self._storing: dict[ChunkKey, int] = {}
        self._pins: dict[ChunkKey, int] = {}
        # Left behind by reset: stores whose completion must free the slot, and pinned entries whose
        # last unpin frees it. Their keys stay unavailable until then, so that a late completion or unpin
        # can never be mistaken for one of a new entry with the same key.
        self._doomed: dict[ChunkKey, int] = {}
        self._orphans: dict[ChunkKey, int] = {}
        self._events: list[PoolEvent] = []
        self._evictions = 0

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

    # -- two-phase store -------------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[ChunkKey]) -> StorePlan:
        """Reserve slots for the ``keys`` that are neither ready nor being stored.

        Takes free slots first, then evicts unpinned ready chunks in policy order, never one of ``keys``.
        Stops at the first new key that finds no slot: a chunk stored after a gap is no use to a prefix
        lookup. The reserved keys stay invisible until ``complete_store``.
        """
        ready, storing, free = self._ready, self._storing, self._free
        limbo = bool(self._doomed or self._orphans)
        new: dict[ChunkKey, None] = {}
        for key in keys:
            # _known inlined: this loop is the hot path
            if not (key in ready or key in storing or (limbo and self._in_limbo(key))):
                new[key] = None
        slots = free[: len(free) - len(new) - 1 : -1]
        del free[len(free) - len(slots) :]
        evicted: list[ChunkKey] = []
        if len(slots) < len(new):
            shielded = self._shield(keys)
            evicted = self._policy.evict(len(new) - len(slots))
            self._policy.readmit(shielded)
            slots.extend([ready.pop(key) for key in evicted])
        reserved = tuple(zip(new, slots, strict=False))
        storing.update(reserved)
        gone = tuple(evicted)
        if gone:
            self._evictions += len(gone)
            self._events.append(PoolEvent(PoolEventKind.REMOVED, gone))
        return StorePlan(slots=reserved, evicted=gone, skipped=len(keys) - len(new))

    def complete_store(self, keys: Sequence[ChunkKey], success: bool) -> None:
        """Finish the stores of ``keys``: on success they become ready (most recently used), on failure
        their slots are freed. Keys not being stored are ignored, so a second call changes nothing."""
        storing, ready, free = self._storing, self._ready, self._free
        stored: list[ChunkKey] = []
        for key in keys:
            slot = storing.pop(key, None)
            if slot is None:
                if self._doomed:
                    slot = self._doomed.pop(key, None)
                    if slot is not None:
                        free.append(slot)
            elif success:
                ready[key] = slot
                stored.append(key)
            else:
                free.append(slot)
        if stored:
            self._policy.insert(stored)
            self._events.append(PoolEvent(PoolEventKind.STORED, tuple(stored)))

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
            else:
                del pins[key]
                if key in self._ready:
                    released.append(key)
                else:
                    self._free.append(self._orphans.pop(key))
        self._policy.readmit(released)

    # -- whole pool ------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every chunk, with jobs in flight.

        Ready chunks leave the index now (one REMOVED event); the slots of unpinned ones are free at once,
        pinned ones keep theirs until their last unpin. Stores in progress are doomed: their completion
        frees the slot, whatever its outcome, and never publishes the key.
        """
        ready, pins = self._ready, self._pins
        if ready:
            self._events.append(PoolEvent(PoolEventKind.REMOVED, tuple(ready)))
        for key, slot in ready.items():
            if key in pins:
                self._orphans[key] = slot
            else:
                self._free.append(slot)
        ready.clear()
        self._doomed.update(self._storing)
        self._storing.clear()
        self._policy.clear()

    def take_events(self) -> tuple[PoolEvent, ...]:
        """The events since the last call, oldest first."""
        events = tuple(self._events)
        self._events.clear()
        return events

    def usage(self) -> PoolUsage:
        """Slot accounting now; see ``PoolUsage``."""
        return PoolUsage(
            capacity=self._capacity,
            used=self._capacity - len(self._free),
            ready=len(self._ready),
            storing=len(self._storing) + len(self._doomed),
            pinned=len(self._pins),
            evictions=self._evictions,
        )

    # -- helpers ---------------------------------------------------------------------------------------

    def _in_limbo(self, key: ChunkKey) -> bool:
        return key in self._doomed or key in self._orphans

    def _known(self, key: ChunkKey) -> bool:
        """Ready or in progress: ``prepare_store`` leaves it alone."""
        return key in self._ready or key in self._storing or self._in_limbo(key)

    def _shield(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Take the evictable ones among ``keys`` out of the policy, so that a store never evicts a chunk
        of its own prefix; the caller readmits them."""
        ready, pins = self._ready, self._pins
        shielded = list(dict.fromkeys([key for key in keys if key in ready and key not in pins]))
        self._policy.discard(shielded)
        return shielded
