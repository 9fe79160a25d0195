"""The ``lmcache_mp`` backend's registration (``kvcore.backends``): an LMCache multiprocess server, with
or without a host pool in front. Importing it loads no socket library; the server is reached on first
use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvcore.config import KVCoreConfig
from kvcore.model.engine import EngineSpec
from kvcore.model.head_runs import HeadRuns
from kvcore.plugins import RemotePort, settings_of
from kvcore.plugins.sizing import keeps_head_values, pool_slots, slot_bytes
from kvcore.ports import ChunkIndex, RankMemory
from kvcore_lmcache.config import LMCacheMPConfig

if TYPE_CHECKING:
    from kvcore.plugins.preflight import Finding, PreflightContext

__all__ = ["BACKEND", "LMCacheBackend"]


class LMCacheBackend:
    """The scheduler looks chunks up on the server, keeping the read locks of what a load will read for
    the ranks (the lock hand-over); each rank stores and retrieves them through the server's
    shared-memory slots: from its host pool, or straight from the engine's blocks when it has none. The
    server keeps a value per KV head (``PER_HEAD``) where the engine's heads are runs of a block, so
    that engines of every TP size share them."""

    kind = "lmcache_mp"
    config_class = LMCacheMPConfig

    def preflight(self, config: KVCoreConfig, context: PreflightContext) -> Iterable[Finding]:
        """What the engine would refuse or warn of (``kvcore_lmcache.preflight``), found without opening
        anything."""
        from kvcore_lmcache.preflight import lmcache_findings

        return lmcache_findings(settings_of(config, LMCacheMPConfig), context)

    def open_index(self, config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
        from kvcore_lmcache.index import LMCacheChunkIndex

        return LMCacheChunkIndex(
            _settings(config),
            value_bytes=_value_bytes(config, engine),
            chunk_tokens=config.chunk_tokens,
            model_name=engine.model_id,
            block_bytes=_block_bytes(config, engine),
        )

    def open_remote(self, config: KVCoreConfig, engine: EngineSpec, memory: RankMemory) -> RemotePort | None:
        from kvcore_lmcache.tier import LMCacheManagedTier

        return LMCacheManagedTier(
            _settings(config),
            memory.host,
            value_bytes=_value_bytes(config, engine),
            chunk_tokens=config.chunk_tokens,
            model_name=engine.model_id,
            block_movers=memory.movers if memory.host is None else None,
            block_bytes=_block_bytes(config, engine),
            heads=_heads(config, engine),
        )


def _heads(config: KVCoreConfig, engine: EngineSpec) -> HeadRuns | None:
    """The rank's KV heads where the server keeps a value per head and the rank holds several (a rank
    of one head keeps its one value, under that head's key), else ``None``."""
    runs = HeadRuns.of(engine) if keeps_head_values(config, engine) else None
    return runs if runs is not None and runs.heads > 1 else None


def _value_bytes(config: KVCoreConfig, engine: EngineSpec) -> int:
    """The bytes of one value: a slot, or one head's part of it. Part of the server-side model name, so
    equal at every TP size where values are per head."""
    heads = _heads(config, engine)
    return slot_bytes(config, engine) // (1 if heads is None else heads.heads)


def _block_bytes(config: KVCoreConfig, engine: EngineSpec) -> int:
    """The alignment of values in the server's slots: one host block (or one head's part of it) when
    blocks move straight between the engine and the slots (no host pool), else none."""
    if pool_slots(config, engine, engine.tp_size):
        return 1
    heads = _heads(config, engine)
    return engine.host_block_bytes if heads is None else heads.head_bytes


def _settings(config: KVCoreConfig) -> LMCacheMPConfig:
    return settings_of(config, LMCacheMPConfig)


BACKEND = LMCacheBackend()
