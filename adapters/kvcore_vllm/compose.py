"""The vLLM adapter's composition root: the one module of the adapter that names backends.

It turns the validated config into the scheduler-side core and each rank's worker, by the config's
``backend.kind``: the CPU tier alone, or the CPU tier in front of a Mooncake store. Backends other than
the CPU tier are imported only when configured, so an install without them still runs the CPU tier.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.config import KVCoreConfig, MooncakeStoreConfig
from kvcore.engine import EngineSpec
from kvcore.errors import UnsupportedConfiguration
from kvcore.ports import ChunkIndex
from kvcore.remote import StoreRemote
from kvcore.scheduler import CacheScheduler
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.tier import CPUWorker, RemoteFactory, open_worker, pool_slots

__all__ = ["RankWorker", "open_rank_worker", "scheduler_core"]

RankWorker = CPUWorker


def scheduler_core(config: KVCoreConfig, engine: EngineSpec, hash_identity: str) -> CacheScheduler:
    world = engine.tp_size
    slots = pool_slots(config, engine, world)
    return CacheScheduler(
        config, engine, slots, world_size=world, hash_identity=hash_identity, remote=_remote_index(config)
    )


def open_rank_worker(
    config: KVCoreConfig, engine: EngineSpec, tensors: Sequence[torch.Tensor], rank: int
) -> RankWorker:
    return open_worker(
        config, engine, tensors, rank=rank, world_size=engine.tp_size, remote=_remote_factory(config)
    )


def _remote_index(config: KVCoreConfig) -> ChunkIndex | None:
    backend = config.backend
    if isinstance(backend, MooncakeStoreConfig):
        from kvcore_mooncake.index import MooncakeChunkIndex  # only when configured

        return MooncakeChunkIndex.open(backend, config.lookup_timeout_s)
    if backend.KIND != "cpu":
        raise UnsupportedConfiguration(f"backend {backend.KIND!r} is not wired into vLLM yet")
    return None


def _remote_factory(config: KVCoreConfig) -> RemoteFactory | None:
    backend = config.backend
    if isinstance(backend, MooncakeStoreConfig):
        from kvcore_mooncake.store import MooncakeChunkStore  # only when configured

        def open_store(host: HostMemory) -> StoreRemote:
            return StoreRemote(MooncakeChunkStore.open(backend, host.buffer.data_ptr(), host.nbytes))

        return open_store
    return None
