"""Which chunks are worth saving: with ``save_after_sightings`` N > 1, only chunks that N requests looked
up (a prompt seen once is not worth a slot); N = 1 admits every full chunk."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from kvcore.ids import ChunkKey

__all__ = ["Sightings"]

_MIN_REMEMBERED = 4096
"""Chunks whose sightings are remembered at least: a pool of a few slots, or none, must still count the
sightings of more than one request's chunks."""


class Sightings:
    """How often each chunk was looked up, bounded (the chunks seen longest ago are forgotten first)."""

    def __init__(self, needed: int, num_slots: int) -> None:
        self.needed = needed
        self._bound = max(4 * num_slots, _MIN_REMEMBERED)
        self._counts: OrderedDict[ChunkKey, int] = OrderedDict()

    @property
    def active(self) -> bool:
        """Whether a chunk must be seen more than once to be saved."""
        return self.needed > 1

    def sight(self, keys: Sequence[ChunkKey]) -> None:
        """One more request looked these chunks up."""
        if not self.active:
            return
        counts = self._counts
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
            counts.move_to_end(key)
        while len(counts) > self._bound:
            counts.popitem(last=False)

    def admitted(self, keys: Sequence[ChunkKey]) -> tuple[ChunkKey, ...]:
        """The leading ``keys`` seen often enough to be saved."""
        if not self.active:
            return tuple(keys)
        return tuple(itertools.takewhile(lambda k: self._counts.get(k, 0) >= self.needed, keys))

    def clear(self) -> None:
        self._counts.clear()
