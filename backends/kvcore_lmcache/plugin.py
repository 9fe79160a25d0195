"""The ``lmcache_mp`` backend's registration (``kvcore.backends``): an LMCache multiprocess server, with
or without a host pool in front. Importing it loads no socket library; the server is reached on first
use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvcore.config import KVCoreConfig
from kvcore.model.engine import EngineSpec
from kvcore.plugins import RemotePort, settings_of
from kvcore.plugins.sizing import pool_slots, slot_bytes
from kvcore.ports import ChunkIndex, RankMemory
from kvcore_lmcache.config import LMCacheMPConfig

if TYPE_CHECKING:
    from kvcore.plugins.preflight import Finding, PreflightContext

__all__ = ["BACKEND", "LMCacheBackend"]


class LMCacheBackend:
    """The scheduler looks chunks up on the server, keeping the read locks of what a load will read for
    the ranks (the lock hand-over); each rank stores and retrieves them through the server's
    shared-memory slots: from its host pool, or straight from the engine's blocks when it has none."""

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
            value_bytes=slot_bytes(config, engine),
            chunk_tokens=config.chunk_tokens,
            model_name=engine.model_id,
            block_bytes=_block_bytes(config, engine),
        )

    def open_remote(self, config: KVCoreConfig, engine: EngineSpec, memory: RankMemory) -> RemotePort | None:
        from kvcore_lmcache.tier import LMCacheManagedTier

        return LMCacheManagedTier(
            _settings(config),
            memory.host,
            value_bytes=slot_bytes(config, engine),
            chunk_tokens=config.chunk_tokens,
            model_name=engine.model_id,
            block_movers=memory.movers if memory.host is None else None,
            block_bytes=_block_bytes(config, engine),
        )


def _block_bytes(config: KVCoreConfig, engine: EngineSpec) -> int:
    """The alignment of values in the server's slots: one host block when blocks move straight between
    the engine and the slots (no host pool), else none."""
    return engine.host_block_bytes if pool_slots(config, engine, engine.tp_size) == 0 else 1


def _settings(config: KVCoreConfig) -> LMCacheMPConfig:
    return settings_of(config, LMCacheMPConfig)


BACKEND = LMCacheBackend()
