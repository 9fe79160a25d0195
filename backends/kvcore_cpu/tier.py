"""Composition of the CPU tier: how many host slots a config buys, and a rank's worker over them.

The scheduler side (``kvcore.scheduler.CacheScheduler``) indexes the slots; each worker holds the slot
memory of its own rank and executes copies (DESIGN §3). ``size`` in the config is the total across the
ranks of one engine, so each rank gets ``size / world_size`` bytes, in whole slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.config import CPUBackendConfig, KVCoreConfig
from kvcore.engine import EngineSpec
from kvcore.errors import ConfigError, InvalidSpecError
from kvcore.worker import BlockWorker
from kvcore_cpu.checksums import ChecksummedMover
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.mover import TorchBlockMover

__all__ = ["CPUWorker", "open_worker", "pool_slots"]


def pool_slots(config: KVCoreConfig, engine: EngineSpec, world_size: int = 1) -> int:
    """Host slots (one chunk of one rank's shard each) that ``config.backend.size`` buys per rank."""
    backend = config.backend
    if not isinstance(backend, CPUBackendConfig):
        raise ConfigError("backend.kind", getattr(backend, "KIND", backend), "'cpu'")
    blocks_per_chunk = config.chunk_tokens // engine.layout.block_tokens
    slot_bytes = blocks_per_chunk * engine.host_block_bytes
    slots = backend.size // world_size // slot_bytes
    if slots < 1:
        raise ConfigError(
            "backend.size",
            backend.size,
            f"at least {slot_bytes * world_size} bytes: one chunk of {config.chunk_tokens} tokens "
            f"({slot_bytes} bytes) on each of {world_size} rank(s)",
        )
    return slots


class CPUWorker(BlockWorker):
    """A rank's executor over its own host slots; ``close`` joins the copy thread and frees the memory.

    ``engine_kv`` and ``host`` stay reachable for out-of-band checks (tests compare their bytes).
    """

    def __init__(
        self,
        mover: TorchBlockMover,
        engine_kv: EngineKV,
        host: HostMemory,
        rank: int,
        checksums: bool = False,
    ) -> None:
        self.checksums = ChecksummedMover(mover, self.host_block_bytes) if checksums else None
        super().__init__(self.checksums or mover, rank)
        self.mover = mover
        self.engine_kv = engine_kv
        self.host = host

    def engine_block_bytes(self, block: int) -> bytes:
        """An engine block's bytes in host-block order (every plane of every layer)."""
        return b"".join(plane[block].cpu().numpy().tobytes() for plane in self.engine_kv.planes)

    def host_block_bytes(self, block: int) -> bytes:
        return bytes(self.host.blocks[block].numpy().tobytes())

    def close(self) -> None:
        self.mover.close()
        self.host.close()


def open_worker(
    config: KVCoreConfig,
    engine: EngineSpec,
    tensors: Sequence[torch.Tensor],
    *,
    rank: int = 0,
    world_size: int = 1,
) -> CPUWorker:
    """Register the rank's KV tensors, allocate its host slots and start its mover."""
    if len(tensors) != engine.num_layers:
        raise InvalidSpecError(f"{len(tensors)} KV tensors given, the engine has {engine.num_layers} layers")
    slots = pool_slots(config, engine, world_size)
    kv = EngineKV.register(tensors, engine.layout)
    blocks_per_chunk = config.chunk_tokens // engine.layout.block_tokens
    host = HostMemory.allocate(slots * blocks_per_chunk, kv.host_block_bytes, kv.device)
    return CPUWorker(TorchBlockMover(kv, host), kv, host, rank, checksums=config.checksums)
