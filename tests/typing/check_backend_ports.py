"""Checked by mypy, never run: each in-tree backend satisfies the ports it claims."""

from __future__ import annotations

from kvcore.block_pool import BlockPool
from kvcore.pool_index import PoolIndex
from kvcore.ports import BlockMover, ChunkIndex, SupportsImmediateLookup
from kvcore_cpu.mover import TorchBlockMover


def cpu_mover(mover: TorchBlockMover) -> BlockMover:
    return mover


def pool_index(pool: BlockPool) -> tuple[ChunkIndex, SupportsImmediateLookup]:
    index = PoolIndex(pool)
    return index, index
