"""Composition of the CPU tier: how many host slots a config buys, and a rank's worker over them.

The scheduler side (``kvcore.scheduler.CacheScheduler``) indexes the slots; each worker holds the slot
memory of its own rank and executes copies (docs/architecture.md, "Where things run"). ``size`` in the
config is the total across the ranks of one engine, so each rank gets ``size / world_size`` bytes, in
whole slots.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence

import torch

from kvcore.checks import SIZE_LIMIT, is_int_in
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
    """Bytes of one host slot: one chunk of one rank's shard, every layer. Raises ``ConfigError`` when
    ``chunk_tokens`` is not a multiple of the engine's block size."""
    return engine.blocks_per_chunk(config.chunk_tokens) * engine.host_block_bytes


def pool_slots(config: KVCoreConfig, engine: EngineSpec, world_size: int = 1) -> int:
    """Host slots (one chunk of one rank's shard each) that the backend's host memory buys per rank
    (``size`` for the CPU tier, ``local_size`` in front of a remote tier). 0 for a backend that moves
    blocks straight to its own memory and was given no host memory (``DIRECT``).

    Raises ``ConfigError`` for a ``world_size`` other than the engine's ``tp_size``, a ``chunk_tokens``
    that is not a multiple of the block size, or a size below one slot on each rank.
    """
    _check_world(engine, world_size)
    one = slot_bytes(config, engine)
    backend = config.backend
    if backend.DIRECT and backend.host_bytes == 0:
        return 0
    slots = backend.host_bytes // world_size // one
    if slots < 1:
        raise ConfigError(
            f"backend.{backend.HOST_FIELD}",
            backend.host_bytes,
            f"at least {one * world_size} bytes: one chunk of {config.chunk_tokens} tokens "
            f"({one} bytes) on each of {world_size} rank(s)",
        )
    return slots


def _check_world(engine: EngineSpec, world_size: int) -> None:
    """The ranks of one engine are its tensor-parallel ranks: host memory is split among exactly those."""
    if not is_int_in(world_size, 1, SIZE_LIMIT) or world_size != engine.tp_size:
        raise ConfigError("world_size", world_size, f"the engine's tp_size {engine.tp_size}")


class MappedMover(TorchBlockMover):
    """A mover between the engine's blocks and host memory that another owner maps here (a remote tier's
    own: an LMCache server's shared-memory pool), page-locked for a CUDA engine until ``close``.

    It holds an export of the mapping, so that its owner cannot unmap it under a copy (an ``mmap``'s
    ``close`` refuses while one exists); the mapping goes once the mover is closed and dropped.
    """

    def __init__(self, engine: EngineKV, buffer: mmap.mmap | bytearray) -> None:
        """Raises ``ConfigError`` for a buffer that holds not one host block (as ``HostMemory.wrap``),
        and whatever ``TorchBlockMover`` raises; the mapping is then left as it was."""
        self._export = memoryview(buffer)
        # torch cannot view an empty buffer; an empty tensor is refused by wrap like any short one
        view = (
            torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
        )
        try:
            self.host = HostMemory.wrap(view, engine.host_block_bytes, engine.device)
        except BaseException:
            self._export.release()
            raise
        try:
            super().__init__(engine, self.host)
        except BaseException:
            self.host.close()
            self._export.release()
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
        fence_timeout: float = 30.0,
    ) -> None:
        self.checksums = ChecksummedMover(mover, self.host_block_bytes) if checksums and mover else None
        super().__init__(self.checksums or mover, rank, remote, slot_bytes, fence_timeout=fence_timeout)
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
    0) gets no slots and no mover: its remote tier moves every block.

    Raises ``ConfigError`` for a ``world_size`` other than the engine's ``tp_size`` or a ``rank`` outside
    it (and as ``pool_slots``), ``InvalidSpecError`` for tensors that do not match the engine (layer
    count, layout, ``kv_dtype``); nothing stays allocated.
    """
    _check_world(engine, world_size)
    if not is_int_in(rank, 0, world_size - 1):
        raise ConfigError("rank", rank, f"an int in [0, {world_size}) (the engine's tp_size)")
    slots = pool_slots(config, engine, world_size)
    kv = EngineKV.register(tensors, engine.layout, kv_dtype=engine.kv_dtype)
    if kv.num_layers != engine.num_layers:
        raise InvalidSpecError(
            f"tensors: got {kv.num_layers} KV tensors, expected {engine.num_layers} (the engine's layers)"
        )
    if slots == 0:
        if remote is None:
            raise ConfigError(f"backend.{config.backend.HOST_FIELD}", 0, "a size for the host pool")
        return CPUWorker(
            None, kv, None, rank, remote=remote(kv, None), fence_timeout=config.transfer_timeout_s
        )
    blocks_per_chunk = engine.blocks_per_chunk(config.chunk_tokens)
    host = HostMemory.allocate(slots * blocks_per_chunk, kv.host_block_bytes, kv.device)
    mover: TorchBlockMover | None = None
    try:
        mover = TorchBlockMover(kv, host)
        tier = remote(kv, host) if remote is not None else None
    except BaseException:
        if mover is not None:
            mover.close()
        host.close()
        raise
    return CPUWorker(
        mover,
        kv,
        host,
        rank,
        config.checksums,
        tier,
        slot_bytes(config, engine) if tier is not None else 0,
        config.transfer_timeout_s,
    )
