"""The local pool of host slots, on the scheduler side: its index of chunks and slots (``block_pool``),
what goes first (``eviction``), what is worth a slot (``admission``), its ``ChunkIndex`` face
(``pool_index``) and which dirty chunks are written back, and when (``write_back``)."""

from __future__ import annotations

from kvcore.pool.block_pool import BlockPool, PoolEvent, PoolEventKind, PoolUsage

__all__ = ["BlockPool", "PoolEvent", "PoolEventKind", "PoolUsage"]
