"""The lazy store policy's eyes on vLLM's own cache: which freed blocks vLLM evicted in this step.

vLLM evicts a cached block only when ``schedule()`` hands it to a request (its free queue is LRU), and
the new owner's forward pass (or a load) overwrites it later in the same step. Until then the block
still holds the KV of its old hash. So the scheduler side records, when a request frees its blocks
(finish, preemption), the hash each block holds and the request's block table; each step it shows
``EvictionWatch`` the blocks vLLM allocated. A recorded block that no longer holds its hash was evicted
in this step: its chain of hashes, with the blocks that still hold each earlier hash, is what a save
needs. The workers copy those blocks in ``handle_preemptions``, which vLLM calls before the forward pass
and before loads, so the copy reads the old KV, never the new owner's.

A block that was written since it was recorded would have shown up in an earlier step's allocations
(every block a forward pass writes belongs to a scheduled request), where its record is dropped: a
record is never trusted past a reuse. Missing an eviction costs a future miss, never wrong KV.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from attrs import frozen

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

__all__ = ["EvictedChain", "EvictionWatch"]

_GROUP = 0  # kvcore_vllm serves one KV-cache group (engine_spec refuses more)


@frozen
class EvictedChain:
    """A prefix of one request's block hashes whose block ``len(hashes) - 1`` (at least) was evicted.

    ``block_ids[i]`` is the vLLM block that holds ``hashes[i]``'s KV until this step's forward pass, or
    ``None`` where no block does any more.
    """

    hashes: tuple[bytes, ...]
    block_ids: tuple[int | None, ...]


class EvictionWatch:
    """Remembers what each freed vLLM block holds; names the chains whose blocks vLLM just evicted."""

    def __init__(self) -> None:
        self._pool: BlockPool | None = None
        # block id -> (hashes of the request that freed it, its block table, the block's index in both)
        self._held: dict[int, tuple[tuple[bytes, ...], tuple[int, ...], int]] = {}

    def bind(self, pool: BlockPool) -> None:
        """vLLM's block pool (``bind_gpu_block_pool``): without it nothing is watched."""
        self._pool = pool

    @property
    def bound(self) -> bool:
        return self._pool is not None

    def freed(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """A request gives its blocks back to vLLM; its full blocks keep their KV until evicted."""
        if self._pool is None:
            return
        hashes, blocks = tuple(block_hashes), tuple(block_ids)
        for i in range(min(len(hashes), len(blocks))):
            self._held[blocks[i]] = (hashes, blocks, i)

    def evicted(self, allocated: Iterable[int]) -> list[EvictedChain]:
        """The chains evicted by this step's allocations (``allocated``: every block id handed to a
        scheduled request in this step), each up to its deepest evicted block."""
        pool = self._pool
        if pool is None or not self._held:
            return []
        from vllm.v1.core.kv_cache_utils import get_block_hash

        gone: dict[int, bytes] = {}  # evicted block -> the hash whose KV it still holds
        deepest: dict[int, tuple[tuple[bytes, ...], tuple[int, ...], int]] = {}
        for block_id in allocated:
            record = self._held.pop(block_id, None)
            if record is None:
                continue
            hashes, _, i = record
            now = pool.blocks[block_id].block_hash
            if now is not None and get_block_hash(now) == hashes[i]:
                continue  # a prefix hit: the block was reused as it is, not evicted
            gone[block_id] = hashes[i]
            best = deepest.get(id(hashes))
            if best is None or best[2] < i:
                deepest[id(hashes)] = record
        return [self._chain(pool, hashes, blocks, i, gone) for hashes, blocks, i in deepest.values()]

    def clear(self) -> None:
        """Forget every record (vLLM's prefix cache was reset: nothing freed before is worth saving)."""
        self._held.clear()

    @staticmethod
    def _chain(
        pool: BlockPool,
        hashes: tuple[bytes, ...],
        blocks: tuple[int, ...],
        last: int,
        gone: dict[int, bytes],
    ) -> EvictedChain:
        from vllm.v1.core.kv_cache_utils import BlockHash, get_block_hash

        holders: list[int | None] = []
        for i in range(last + 1):
            block_id: int | None = blocks[i]
            if block_id is not None and gone.get(block_id) != hashes[i]:
                held = pool.blocks[block_id].block_hash
                if held is None or get_block_hash(held) != hashes[i]:
                    cached = pool.get_cached_block(BlockHash(hashes[i]), [_GROUP])
                    block_id = cached[0].block_id if cached else None
            holders.append(block_id)
        return EvictedChain(hashes[: last + 1], tuple(holders))
