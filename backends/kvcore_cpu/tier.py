"""Composition of the CPU tier: how many host slots a config buys, and a rank's worker over them.

The scheduler side (``kvcore.scheduler.CacheScheduler``) indexes the slots; each worker holds the slot
memory of its own rank and executes copies (DESIGN §3). ``size`` in the config is the total across the
ranks of one engine, so each rank gets ``size / world_size`` bytes, in whole slots.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence

import torch

from kvcore.config import KVCoreConfig
from kvcore.engine import EngineSpec
from kvcore.errors import ConfigError, InvalidSpecError, UsageError
from kvcore.remote import RemoteTier, close_quietly
from kvcore.worker import BlockWorker
from kvcore_cpu.checksums import ChecksummedMover
from kvcore_cpu.cuda_lane import stream_mark
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.mover import TorchBlockMover

__all__ = [
    "CPUWorker",
    "MappedMover",
    "MappedMovers",
    "RemoteFactory",
    "open_worker",
    "pool_slots",
    "slot_bytes",
]


RemoteFactory = Callable[[EngineKV, HostMemory | None], RemoteTier]
"""Opens a rank's remote tier for its engine KV, over its host memory (registered once, the staging of
every transfer), or with ``None`` when the rank has no host pool and the tier moves blocks itself."""


def slot_bytes(config: KVCoreConfig, engine: EngineSpec) -> int:
    """Bytes of one host slot: one chunk of one rank's shard, every layer."""
    return config.chunk_tokens // engine.layout.block_tokens * engine.host_block_bytes


def pool_slots(config: KVCoreConfig, engine: EngineSpec, world_size: int = 1) -> int:
    """Host slots (one chunk of one rank's shard each) that the backend's host memory buys per rank
    (``size`` for the CPU tier, ``local_size`` in front of a remote tier). 0 for a backend that moves
    blocks straight to its own memory and was given no host memory (``DIRECT``)."""
    backend = config.backend
    if backend.DIRECT and backend.host_bytes == 0:
        return 0
    one = slot_bytes(config, engine)
    slots = backend.host_bytes // world_size // one
    if slots < 1:
        raise ConfigError(
            f"backend.{backend.HOST_FIELD}",
            backend.host_bytes,
            f"at least {one * world_size} bytes: one chunk of {config.chunk_tokens} tokens "
            f"({one} bytes) on each of {world_size} rank(s)",
        )
    return slots


class MappedMover(TorchBlockMover):
    """A mover between the engine's blocks and host memory that another owner maps here (a remote tier's
    own: an LMCache server's shared-memory pool), page-locked for a CUDA engine until ``close``.

    It holds an export of the mapping, so that its owner cannot unmap it under a copy (an ``mmap``'s
    ``close`` refuses while one exists); the mapping goes once the mover is closed and dropped.
    """

    def __init__(self, engine: EngineKV, buffer: mmap.mmap | bytearray) -> None:
        self._export = memoryview(buffer)
        self.host = HostMemory.wrap(
            torch.frombuffer(buffer, dtype=torch.uint8), engine.host_block_bytes, engine.device
        )
        try:
            super().__init__(engine, self.host)
        except BaseException:
            self.host.close()
            raise

    def close(self, timeout: float = 5.0) -> None:
        super().close(timeout)
        self.host.close()
        self._export.release()


class MappedMovers:
    """Movers over memory that a remote tier maps, for one engine's KV (``kvcore_lmcache``'s
    ``BlockMovers``), and marks of that engine's queued work."""

    def __init__(self, engine: EngineKV) -> None:
        self._engine = engine

    def mark(self) -> object:
        """A CUDA event after the engine's queued work on the calling thread's stream (``None`` on a CPU
        engine, whose work is done when it calls kvcore)."""
        device = self._engine.device
        return stream_mark(device) if device.type == "cuda" else None

    def over(self, pool: mmap.mmap) -> MappedMover:
        return MappedMover(self._engine, pool)


class CPUWorker(BlockWorker):
    """A rank's executor over its own host slots; ``close`` joins the copy thread and frees the memory.

    ``engine_kv`` and ``host`` stay reachable for out-of-band checks (tests compare their bytes). A rank
    with no host pool (``mover`` and ``host`` ``None``) leaves every copy to its remote tier.
    """

    def __init__(
        self,
        mover: TorchBlockMover | None,
        engine_kv: EngineKV,
        host: HostMemory | None,
        rank: int,
        checksums: bool = False,
        remote: RemoteTier | None = None,
        slot_bytes: int = 0,
    ) -> None:
        self.checksums = ChecksummedMover(mover, self.host_block_bytes) if checksums and mover else None
        super().__init__(self.checksums or mover, rank, remote, slot_bytes)
        self.remote = remote
        self.mover = mover
        self.engine_kv = engine_kv
        self.host = host

    def engine_block_bytes(self, block: int) -> bytes:
        """An engine block's bytes in host-block order (every plane of every layer)."""
        return b"".join(plane[block].cpu().numpy().tobytes() for plane in self.engine_kv.planes)

    def host_block_bytes(self, block: int) -> bytes:
        if self.host is None:
            raise UsageError("this worker has no host pool")
        return bytes(self.host.blocks[block].numpy().tobytes())

    def halt(self) -> None:
        """Stop for good every copy that could still write engine blocks (joining its thread): the
        mover's, or, with no host pool, the remote tier's own."""
        if self.mover is not None:
            self.mover.close()
        elif self.remote is not None:
            close_quietly(self.remote)

    def close(self) -> None:
        """Stop the remote tier, then the mover, then free the memory both use."""
        if self.remote is not None:
            close_quietly(self.remote)
        if self.mover is not None:
            self.mover.close()
        if self.host is not None:
            self.host.close()


def open_worker(
    config: KVCoreConfig,
    engine: EngineSpec,
    tensors: Sequence[torch.Tensor],
    *,
    rank: int = 0,
    world_size: int = 1,
    remote: RemoteFactory | None = None,
) -> CPUWorker:
    """Register the rank's KV tensors, allocate its host slots and start its mover; with ``remote``, open
    the rank's remote tier over those slots. A backend configured with no host memory (``pool_slots``
    0) gets no slots and no mover: its remote tier moves every block."""
    if len(tensors) != engine.num_layers:
        raise InvalidSpecError(f"{len(tensors)} KV tensors given, the engine has {engine.num_layers} layers")
    slots = pool_slots(config, engine, world_size)
    kv = EngineKV.register(tensors, engine.layout)
    if slots == 0:
        if remote is None:
            raise ConfigError(f"backend.{config.backend.HOST_FIELD}", 0, "a size for the host pool")
        return CPUWorker(None, kv, None, rank, remote=remote(kv, None))
    blocks_per_chunk = config.chunk_tokens // engine.layout.block_tokens
    host = HostMemory.allocate(slots * blocks_per_chunk, kv.host_block_bytes, kv.device)
    mover = TorchBlockMover(kv, host)
    try:
        tier = remote(kv, host) if remote is not None else None
    except BaseException:
        mover.close()
        host.close()
        raise
    return CPUWorker(
        mover, kv, host, rank, config.checksums, tier, slot_bytes(config, engine) if tier is not None else 0
    )
