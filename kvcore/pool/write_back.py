"""Write-back from the pool to the tiers written back (``Tier.write``): which chunks go, and when.

A save's chunks that cross to the remote tiers are *dirty* in the pool (``BlockPool.complete_store``):
served like any other, never evicted, and remembered here with what their write needs (each rank's
shard key, a tail's length). Each step, while fewer than a quarter of the pool's slots are free or hold
chunks an eviction may take (chunks being written back count: they are clean once written), the least
recently used dirty chunks are written back: one op of at most ``BATCH`` chunks a step, no engine block
in it (``BlockOp.write_back``). Their pin is released when every rank reported, whatever the outcome:
a chunk that no tier stored stays in the pool, clean (a cache may lose what it never wrote back).

So a step's saves cost the tiers written back nothing until the pool needs room, and a chunk the pool
would evict reaches them first. What is still dirty when the engine stops, each worker writes back as it
closes (``BlockWorker.close``: it knows which of its slots hold chunks saved and not yet written back).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from kvcore.ids import ChunkKey
from kvcore.model.step import WRITE_BACK_SESSION, BlockOp, RemoteChunk
from kvcore.pool.block_pool import BlockPool
from kvcore.ports import Direction

__all__ = ["BATCH", "WriteBack"]

BATCH = 64
"""The most chunks written back in one step (one op): room is made over a few steps, not in one burst."""

_Target = tuple[tuple[ChunkKey | None, ...], int | None]  # each rank's shard key, a tail's blocks


class WriteBack:
    """The dirty chunks of ``pool`` and their way down (module docstring)."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._low_water = max(1, pool.usage().capacity // 4)
        self._targets: dict[ChunkKey, _Target] = {}  # the pool's dirty chunks (not those being written)
        self._writing = 0  # chunks in write-back ops in flight

    def store(self, good: Collection[ChunkKey], remote: Iterable[tuple[ChunkKey, RemoteChunk]]) -> None:
        """Complete a finished save's ``good`` chunks in the pool: dirty where they cross to the remote
        tiers (``remote``: its op's remote chunks, each with its pool key), clean otherwise."""
        crossing: dict[ChunkKey, _Target] = {}
        for key, chunk in remote:
            if key in good:
                crossing[key] = (chunk.keys, chunk.value_blocks)
        for key in self._pool.complete_store(list(crossing), success=True, dirty=True):
            self._targets[key] = crossing[key]
        self._pool.complete_store([key for key in good if key not in crossing], success=True)

    def take(self, next_id: Callable[[], int]) -> tuple[BlockOp, tuple[ChunkKey, ...]] | None:
        """The write-back op this step needs (its id from ``next_id``), with its chunks' keys (pinned
        until ``finish``); ``None`` while the pool has room enough or nothing dirty."""
        usage = self._pool.usage()
        room = usage.capacity - usage.used + usage.evictable + self._writing
        want = min(self._low_water - room, BATCH)
        if want <= 0 or not usage.dirty:
            return None
        chunks: list[RemoteChunk] = []
        keys: list[ChunkKey] = []
        unwritten: list[ChunkKey] = []
        for key, slot in self._pool.take_dirty(want):
            target = self._targets.pop(key, None)
            if target is None:  # forgotten (suspect bytes): clean, and never written
                unwritten.append(key)
                continue
            shard_keys, value_blocks = target
            chunks.append(RemoteChunk(slot, shard_keys, len(chunks), 1, value_blocks=value_blocks))
            keys.append(key)
        if unwritten:
            self._pool.unpin(unwritten)
        if not keys:
            return None
        self._writing += len(keys)
        op = BlockOp(next_id(), Direction.SAVE, (), (), WRITE_BACK_SESSION, tuple(chunks), write_back=True)
        return op, tuple(keys)

    def finish(self, keys: Sequence[ChunkKey]) -> None:
        """A write-back op of ``keys`` ended: they are clean, evictable again."""
        self._pool.unpin(keys)
        self._writing -= len(keys)

    def forget(self, keys: Iterable[ChunkKey]) -> None:
        """Never write these chunks back (their bytes are suspect); the pool drops or cleans them."""
        for key in keys:
            self._targets.pop(key, None)

    def clear(self) -> None:
        """The pool was reset: its dirty chunks are gone."""
        self._targets.clear()
