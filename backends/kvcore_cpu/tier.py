"""A rank's worker over torch tensors: its host slots, its mover, and its remote tier opened over them.

The scheduler side (``kvcore.scheduling.scheduler.CacheScheduler``) indexes the slots
(``kvcore.plugins.sizing`` says how many a config buys); each worker holds the slot memory of its own rank and
executes copies (docs/architecture.md, "Where things run"). A backend's remote tier sees the rank as a
``RankMemory``.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch
from attrs import frozen

from kvcore.checks import is_int_in
from kvcore.config import KVCoreConfig
from kvcore.errors import ConfigError, InvalidSpecError, UnsupportedConfiguration, UsageError
from kvcore.execution.worker import FLUSH_TIMEOUT_S, BlockWorker
from kvcore.kit.closing import close_quietly
from kvcore.kit.faults import FaultHooks
from kvcore.model.engine import EngineSpec
from kvcore.plugins import MoverWrap, RemoteOpener
from kvcore.plugins.sizing import check_world, host_field, pool_slots, slot_bytes
from kvcore.ports import BlockMover, RemoteTier
from kvcore_cpu.amx import claim_amx
from kvcore_cpu.checksums import ChecksummedMover
from kvcore_cpu.cuda_lane import stream_mark
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.mover import TorchBlockMover, head_runs

__all__ = ["CPUWorker", "MappedMover", "MappedMovers", "TorchRankMemory", "open_rank"]


class MappedMover(TorchBlockMover):
    """A mover between the engine's blocks and host memory that another owner maps here (a remote tier's
    own: an LMCache server's shared-memory pool), page-locked for a CUDA engine until ``close``.

    It holds an export of the mapping, so that its owner cannot unmap it under a copy (an ``mmap``'s
    ``close`` refuses while one exists); the mapping goes once the mover is closed and dropped.
    """

    def __init__(
        self,
        engine: EngineKV,
        buffer: mmap.mmap | bytearray,
        *,
        faults: FaultHooks | None = None,
        per_head: bool = False,
    ) -> None:
        """Raises ``ConfigError`` for a buffer that holds not one host block (as ``HostMemory.wrap``),
        and whatever ``TorchBlockMover`` raises (``faults`` and ``per_head`` as there); the mapping is
        then left as it was."""
        heads = head_runs(engine, per_head=per_head)
        block_bytes = engine.host_block_bytes if heads is None else heads.head_bytes
        self._export = memoryview(buffer)
        # torch cannot view an empty buffer; an empty tensor is refused by wrap like any short one
        view = (
            torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
        )
        try:
            self.host = HostMemory.wrap(view, block_bytes, engine.device)
        except BaseException:
            self._export.release()
            raise
        try:
            super().__init__(engine, self.host, faults=faults, per_head=per_head)
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
    ``BlockMovers``), and marks of that engine's queued work. Each mover gets ``faults``."""

    def __init__(self, engine: EngineKV, *, faults: FaultHooks | None = None) -> None:
        self._engine = engine
        self._faults = faults

    def mark(self) -> object:
        """A CUDA event after the engine's queued work on the calling thread's stream (``None`` on a CPU
        engine, whose work is done when it calls kvcore)."""
        device = self._engine.device
        return stream_mark(device) if device.type == "cuda" else None

    def over(self, pool: mmap.mmap, *, per_head: bool = False) -> MappedMover:
        return MappedMover(self._engine, pool, faults=self._faults, per_head=per_head)


@frozen
class TorchRankMemory:
    """A rank's memory as its remote tier sees it (``kvcore.ports.RankMemory``)."""

    rank: int
    host: memoryview | None
    host_address: int | None
    movers: MappedMovers

    @classmethod
    def of(
        cls, rank: int, engine: EngineKV, host: HostMemory | None, faults: FaultHooks | None = None
    ) -> TorchRankMemory:
        movers = MappedMovers(engine, faults=faults)
        if host is None:
            return cls(rank, None, None, movers)
        return cls(rank, host.buffer.numpy().data, host.buffer.data_ptr(), movers)


class CPUWorker(BlockWorker):
    """A rank's executor over its own host slots; ``close`` joins the copy thread and frees the memory.

    ``engine_kv`` and ``host`` stay reachable for out-of-band checks (tests compare their bytes). A rank
    with no host pool (``mover`` and ``host`` ``None``) leaves every copy to its remote tier.

    ``checksums`` verify the host pool's blocks against digests taken when they were saved, so they
    cannot be combined with a remote tier (a fetched chunk carries no digest, and would fail every
    load): ``UsageError`` naming ``checksums``, raised before anything starts (the caller keeps what it
    passed).
    """

    def __init__(
        self,
        mover: BlockMover | None,
        engine_kv: EngineKV,
        host: HostMemory | None,
        rank: int,
        checksums: bool = False,
        remote: RemoteTier | None = None,
        slot_bytes: int = 0,
        fence_timeout: float = 30.0,
        slot_blocks: int = 0,
    ) -> None:
        if checksums and remote is not None:
            raise UsageError(
                f"checksums: got True with a remote tier ({type(remote).__name__}); checksums cover the "
                "local CPU tier only (a chunk fetched from a remote tier carries no digest)"
            )
        self.checksums = ChecksummedMover(mover, self.host_block_bytes) if checksums and mover else None
        super().__init__(
            self.checksums or mover,
            rank,
            remote,
            slot_bytes,
            slot_blocks=slot_blocks,
            fence_timeout=fence_timeout,
        )
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

    def close(self, flush_timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Write back what is dirty, stop the remote tier, then the mover, then free the memory they use."""
        super().close(flush_timeout)
        if self.host is not None:
            self.host.close()


def open_rank(
    config: KVCoreConfig,
    engine: EngineSpec,
    tensors: Sequence[torch.Tensor],
    *,
    rank: int = 0,
    world_size: int = 1,
    remote: RemoteOpener | None = None,
    faults: FaultHooks | None = None,
    mover: MoverWrap | None = None,
) -> CPUWorker:
    """Register the rank's KV tensors, allocate its host slots and start its mover; with ``remote``, open
    the rank's remote tier over those slots (AMX claimed first: a tier may start native threads). A
    backend configured with no host memory (``pool_slots`` 0) gets no slots and no mover: its remote
    tier moves every block. Every mover of the rank, its own and those its remote tier maps, calls
    ``faults`` (``kvcore.kit.faults``) before each copy; the worker drives ``mover(its own mover)`` where
    ``mover`` is given.

    Raises ``ConfigError`` for a ``world_size`` other than the engine's ``tp_size`` or a ``rank`` outside
    it (and as ``pool_slots``), ``InvalidSpecError`` for tensors that do not match the engine (layer
    count, layout, ``kv_dtype``), ``UnsupportedConfiguration`` for ``faults`` on a CUDA engine (its copies
    run on streams, with no thread to call them); nothing stays allocated.
    """
    check_world(engine, world_size)
    if not is_int_in(rank, 0, world_size - 1):
        raise ConfigError("rank", rank, f"an int in [0, {world_size}) (the engine's tp_size)")
    slots = pool_slots(config, engine, world_size)
    kv = EngineKV.register(tensors, engine.layout, kv_dtype=engine.kv_dtype)
    if kv.num_layers != engine.num_layers:
        raise InvalidSpecError(
            f"tensors: got {kv.num_layers} KV tensors, expected {engine.num_layers} (the engine's layers)"
        )
    if faults is not None and kv.device.type == "cuda":
        raise UnsupportedConfiguration(f"faults: got {faults!r}, expected None on a CUDA engine")
    if slots == 0:
        alone = _open_remote(remote, TorchRankMemory.of(rank, kv, None, faults))
        if alone is None:
            raise ConfigError(host_field(config), 0, "a size for the host pool")
        return CPUWorker(None, kv, None, rank, remote=alone, fence_timeout=config.transfer_timeout_s)
    blocks_per_chunk = engine.blocks_per_chunk(config.chunk_tokens)
    host = HostMemory.allocate(slots * blocks_per_chunk, kv.host_block_bytes, kv.device)
    own: TorchBlockMover | None = None
    tier: RemoteTier | None = None
    try:
        own = TorchBlockMover(kv, host, faults=faults)
        driven = own if mover is None else mover(own)
        tier = _open_remote(remote, TorchRankMemory.of(rank, kv, host, faults))
        return CPUWorker(
            driven,
            kv,
            host,
            rank,
            config.checksums,
            tier,
            slot_bytes(config, engine) if tier is not None else 0,
            config.transfer_timeout_s,
            blocks_per_chunk,
        )
    except BaseException:
        close_quietly(tier)
        if own is not None:
            own.close()
        host.close()
        raise


def _open_remote(remote: RemoteOpener | None, memory: TorchRankMemory) -> RemoteTier | None:
    if remote is None:
        return None
    claim_amx()  # before the tier starts native threads (see kvcore_cpu.amx)
    return remote(memory)
