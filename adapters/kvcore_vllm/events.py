"""kvcore's pool events as vLLM KV cache events, for vLLM's event publisher (``take_events``).

kvcore knows a stored chunk by its chunk key; vLLM's event consumers (KV-aware routers) know blocks by
vLLM's own block hashes. The scheduler side names each chunk before offering it to the pool: the
``chunk_tokens / hash block size`` entries of ``request.block_hashes`` that the chunk covers (without
vLLM's 4-byte KV-cache-group suffix) and the hash of the block before the chunk. A chunk that becomes
ready in the pool is published as one ``BlockStored`` of those block hashes (``block_size`` = vLLM's
hash block size, ``parent_block_hash`` = the block before, medium ``"CPU"``, no token ids: kvcore keeps
none); a chunk that leaves the pool as a ``BlockRemoved`` of the same hashes. Hashes are converted as
vLLM converts its own (64-bit ints under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, its default). A
chunk's last block hash is also its kvcore chunk hash: the key's chunk part is its hex form unless a
deployment ``secret`` is set.

A chunk that a save or a write-back stored in a remote tier behind the pool (every shard of it) is
published once more as a ``BlockStored`` of medium ``"STORAGE"`` (``vllm.distributed.kv_events.
MEDIUM_STORAGE``, as vLLM's own offloading tiers beyond CPU memory publish theirs), while its name is
known (it is in the pool, or was just offered). Remote tiers publish no ``BlockRemoved``: they are
shared with other engines and evict on their own (a Mooncake master, another engine filling a shared
directory), so what they hold later is a hint, not a promise; a lookup finds out.

Names of chunks not (yet) in the pool are bounded, oldest dropped first; a chunk whose name was dropped
before it was stored publishes nothing (a missed event, never a wrong one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvcore.ids import ChunkKey
from kvcore.keying.hashing import regroup_block_hashes
from kvcore.keying.keys import Keyspace
from kvcore.pool.block_pool import PoolEvent, PoolEventKind

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent

__all__ = ["MEDIUM", "REMOTE_MEDIUM", "ChunkNames"]

MEDIUM = "CPU"  # vllm.distributed.kv_events.MEDIUM_CPU: where kvcore's CPU tier keeps the chunks
REMOTE_MEDIUM = "STORAGE"  # vllm.distributed.kv_events.MEDIUM_STORAGE: every remote tier behind the pool

_Name = tuple[tuple[bytes, ...], bytes | None]  # the chunk's block hashes, the hash before them


class ChunkNames:
    """Chunk keys to vLLM block hashes, for the chunks offered to the pool and those it holds."""

    def __init__(
        self, keyspace: Keyspace, chunk_tokens: int, hash_block_tokens: int, bound: int, group: int = 0
    ) -> None:
        self._keyspace = keyspace
        self._group = group  # vLLM's KV-cache group of the chunks
        self._chunk_tokens = chunk_tokens
        self._hash_block_tokens = hash_block_tokens
        self._per_chunk = chunk_tokens // hash_block_tokens
        self._bound = bound
        self._offered: OrderedDict[ChunkKey, _Name] = OrderedDict()
        self._stored: dict[ChunkKey, _Name] = {}  # at most the pool's capacity: each leaves by an event

    def name(self, block_hashes: Sequence[bytes], first_chunk: int, stop_chunk: int) -> int:
        """Remember chunks ``[first_chunk, stop_chunk)`` of a request whose vLLM hashes are given; returns
        the chunk named last plus one (``stop_chunk``, or fewer if the hashes end sooner)."""
        per = self._per_chunk
        stop_chunk = min(stop_chunk, len(block_hashes) // per)
        if stop_chunk <= first_chunk:
            return first_chunk
        covered = block_hashes[first_chunk * per : stop_chunk * per]
        chunk_hashes = regroup_block_hashes(covered, self._hash_block_tokens, self._chunk_tokens)
        offered = self._offered
        for i, key in enumerate(self._keyspace.keys(chunk_hashes), start=first_chunk):
            if key in self._stored:
                continue
            start = i * per
            parent = block_hashes[start - 1] if start else None
            offered[key] = (tuple(block_hashes[start : start + per]), parent)
            offered.move_to_end(key)
        while len(offered) > self._bound:
            offered.popitem(last=False)
        return stop_chunk

    def events(self, pool_events: Iterable[PoolEvent]) -> list[KVCacheEvent]:
        """vLLM's events for the pool's, oldest first."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash, maybe_convert_block_hash

        out: list[KVCacheEvent] = []

        def stored(name: _Name, medium: str) -> BlockStored:
            hashes, parent = name
            return BlockStored(
                block_hashes=[maybe_convert_block_hash(BlockHash(h)) for h in hashes],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(BlockHash(parent)),
                token_ids=[],
                block_size=self._hash_block_tokens,
                lora_id=None,
                medium=medium,
                lora_name=None,
                group_idx=self._group,
            )

        for event in pool_events:
            if event.tier:  # a remote tier holds them now (stores only: it tells of no removal)
                for key in event.keys if event.kind is PoolEventKind.STORED else ():
                    known = self._stored.get(key) or self._offered.get(key)
                    if known is not None:
                        out.append(stored(known, REMOTE_MEDIUM))
            elif event.kind is PoolEventKind.STORED:
                for key in event.keys:
                    name = self._offered.pop(key, None)
                    if name is None:
                        continue
                    self._stored[key] = name
                    out.append(stored(name, MEDIUM))
            else:
                removed: list[ExternalBlockHash] = []
                for key in event.keys:
                    gone = self._stored.pop(key, None)
                    if gone is not None:
                        removed.extend(maybe_convert_block_hash(BlockHash(h)) for h in gone[0])
                if removed:
                    out.append(BlockRemoved(block_hashes=removed, medium=MEDIUM, group_idx=self._group))
        return out
