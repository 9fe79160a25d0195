"""A rank's values as one value per KV head on an LMCache server, so that engines of every
tensor-parallel size share them.

With a value per head, a rank's key is its heads' keys joined (``kvcore.keying.keys.head_keys``). The
server hashes chains, so each head gets a chain of its own: head ``h``'s keys of the request's chunks,
the same at every TP size whichever rank holds the head. A call on the rank's values becomes one per
head: its items under the head's keys, over the head's part of each slot (runs of the host buffer,
``kvcore.model.head_runs``) or of each engine block (head blocks: ``BlockTransfer.head``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.ids import ChunkKey
from kvcore.model.head_runs import HeadRuns
from kvcore.ports import BlockItem, StoreItem

__all__ = ["HOLDER_SEPARATOR", "HeadSplit"]

HOLDER_SEPARATOR = ","
"""Between the server sessions of a rank's heads in the holder a held lookup names for the rank (the
index's sessions are its own, ``kvcore:<link>:index-<n>:<tag>``: never one of these)."""


class HeadSplit:
    """Splits a rank's calls into one per local KV head (``runs``: the rank's heads, more than one)."""

    def __init__(self, runs: HeadRuns) -> None:
        self.runs = runs
        self.heads = runs.heads

    def chains(self, chain: Sequence[ChunkKey]) -> list[tuple[ChunkKey, ...]]:
        """Each head's chain: its keys of ``chain``'s chunks."""
        split = [self.runs.keys(f"chain[{i}]", key) for i, key in enumerate(chain)]
        return [tuple(keys[head] for keys in split) for head in range(self.heads)]

    def store_items(self, items: Sequence[StoreItem]) -> list[list[StoreItem]]:
        """Each head's items: its value of each item's slot (whole host blocks), as runs."""
        split = [self.runs.split(f"items[{i}]", item) for i, item in enumerate(items)]
        return [[parts[head] for parts in split] for head in range(self.heads)]

    def block_items(self, items: Sequence[BlockItem]) -> list[list[BlockItem]]:
        """Each head's items: the same blocks, under its keys (their values are head blocks)."""
        per_head: list[list[BlockItem]] = [[] for _ in range(self.heads)]
        for i, item in enumerate(items):
            for head, key in enumerate(self.runs.keys(f"items[{i}]", item.key)):
                per_head[head].append(BlockItem(key, item.engine_blocks, item.first, item.value_blocks))
        return per_head
