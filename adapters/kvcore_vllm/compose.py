"""The vLLM adapter's composition root: the one module of the adapter that names backends.

It turns the validated config into the scheduler-side core and each rank's worker, by the config's
``backend.kind``: the CPU tier alone, the CPU tier in front of a Mooncake store or an LMCache server, or
an LMCache server alone (no ``local_size``), whose slots the engine's blocks are copied to and from.
Backends other than the CPU tier are imported only when configured, so an install without them still
runs the CPU tier.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcore.config import KVCoreConfig, LMCacheMPConfig, MooncakeStoreConfig
from kvcore.engine import EngineSpec
from kvcore.errors import ConfigError
from kvcore.ports import ChunkIndex
from kvcore.remote import ManagedRemote, StoreRemote
from kvcore.scheduler import CacheScheduler
from kvcore_cpu.amx import claim_amx
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.tier import CPUWorker, MappedMovers, RemoteFactory, open_worker, pool_slots, slot_bytes

__all__ = ["RankWorker", "open_rank_worker", "scheduler_core", "staging_shortfall"]

RankWorker = CPUWorker


def scheduler_core(config: KVCoreConfig, engine: EngineSpec, hash_identity: str) -> CacheScheduler:
    world = engine.tp_size
    slots = pool_slots(config, engine, world)
    return CacheScheduler(
        config,
        engine,
        slots,
        world_size=world,
        hash_identity=hash_identity,
        remote=_remote_index(config, engine),
    )


def staging_shortfall(config: KVCoreConfig, engine: EngineSpec, step_tokens: int) -> str | None:
    """Why the local pool is too small to stage one step's saves to a remote tier, or ``None``.

    Every save to a Mooncake store or an LMCache server goes through a pool slot first, so a pool that
    holds fewer chunks than one engine step computes (``step_tokens``) publishes only what fits.
    """
    backend = config.backend
    if not isinstance(backend, (MooncakeStoreConfig, LMCacheMPConfig)):
        return None
    have = pool_slots(config, engine, engine.tp_size)
    need = -(-step_tokens // config.chunk_tokens)
    if have == 0 or have >= need:  # no pool: the remote tier moves every chunk itself
        return None
    enough = need * engine.tp_size * slot_bytes(config, engine)
    return (
        f"kvcore: backend.{backend.HOST_FIELD}={backend.host_bytes} stages {have} chunk(s) per rank, but "
        f"one step can save {need} ({step_tokens} tokens): saves beyond what fits are neither kept nor "
        f"published to the {backend.KIND} tier; set it to at least {enough} bytes"
    )


def open_rank_worker(
    config: KVCoreConfig, engine: EngineSpec, tensors: Sequence[torch.Tensor], rank: int
) -> RankWorker:
    return open_worker(
        config, engine, tensors, rank=rank, world_size=engine.tp_size, remote=_remote_factory(config, engine)
    )


def _remote_index(config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
    backend = config.backend
    if isinstance(backend, MooncakeStoreConfig):
        from kvcore_mooncake.index import MooncakeChunkIndex  # only when configured

        return MooncakeChunkIndex.open(backend, config.lookup_timeout_s)
    if isinstance(backend, LMCacheMPConfig):
        from kvcore_lmcache.index import LMCacheChunkIndex  # only when configured

        return LMCacheChunkIndex(
            backend,
            value_bytes=slot_bytes(config, engine),
            chunk_tokens=config.chunk_tokens,
            model_name=engine.model_id,
            block_bytes=_lmcache_block_bytes(config, engine),
        )
    return None


def _lmcache_block_bytes(config: KVCoreConfig, engine: EngineSpec) -> int:
    """The alignment of values in the server's slots: one host block when blocks move straight between
    the engine and the slots (no local pool), else none."""
    return engine.host_block_bytes if pool_slots(config, engine, engine.tp_size) == 0 else 1


def _remote_factory(config: KVCoreConfig, engine: EngineSpec) -> RemoteFactory | None:
    backend = config.backend
    if isinstance(backend, MooncakeStoreConfig):
        from kvcore_mooncake.store import MooncakeChunkStore  # only when configured

        def open_store(kv: EngineKV, host: HostMemory | None) -> StoreRemote:
            if host is None:
                raise ConfigError(f"backend.{backend.HOST_FIELD}", 0, "a host pool to stage transfers")
            claim_amx()  # before the Mooncake client starts its threads
            return StoreRemote(MooncakeChunkStore.open(backend, host.buffer.data_ptr(), host.nbytes))

        return open_store
    if isinstance(backend, LMCacheMPConfig):
        from kvcore_lmcache.tier import LMCacheManagedTier  # only when configured

        def open_server(kv: EngineKV, host: HostMemory | None) -> ManagedRemote:
            tier = LMCacheManagedTier(
                backend,
                host.buffer.numpy().data if host is not None else None,
                value_bytes=slot_bytes(config, engine),
                chunk_tokens=config.chunk_tokens,
                model_name=engine.model_id,
                block_movers=MappedMovers(kv) if host is None else None,
                block_bytes=_lmcache_block_bytes(config, engine),
            )
            return ManagedRemote(tier)

        return open_server
    return None
