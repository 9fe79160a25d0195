"""The ``mooncake_store`` backend's registration (``kvcore.backends``): a Mooncake store behind the host
pool. Importing it loads no native library; the client is opened on first use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvcore.config import KVCoreConfig
from kvcore.errors import ConfigError
from kvcore.model.engine import EngineSpec
from kvcore.plugins import RemotePort, settings_of
from kvcore.ports import ChunkIndex, RankMemory
from kvcore_mooncake.config import MooncakeStoreConfig

if TYPE_CHECKING:
    from kvcore.plugins.preflight import Finding, PreflightContext

__all__ = ["BACKEND", "MooncakeBackend"]


class MooncakeBackend:
    """The scheduler asks a pure client of the master which chunks exist; each rank moves chunks
    between its host pool (registered with the transfer engine) and the store."""

    kind = "mooncake_store"
    config_class = MooncakeStoreConfig

    def preflight(self, config: KVCoreConfig, context: PreflightContext) -> Iterable[Finding]:
        """What the engine would refuse or warn of (``kvcore_mooncake.preflight``), found without opening
        anything."""
        from kvcore_mooncake.preflight import mooncake_findings

        return mooncake_findings(settings_of(config, MooncakeStoreConfig), context)

    def open_index(self, config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
        from kvcore_mooncake.index import MooncakeChunkIndex

        return MooncakeChunkIndex.open(settings_of(config, MooncakeStoreConfig), config.lookup_timeout_s)

    def open_remote(self, config: KVCoreConfig, engine: EngineSpec, memory: RankMemory) -> RemotePort | None:
        settings = settings_of(config, MooncakeStoreConfig)
        if memory.host is None or memory.host_address is None:
            raise ConfigError(f"backend.{settings.HOST_FIELD}", 0, "a host pool to stage transfers")
        from kvcore_mooncake.store import MooncakeChunkStore

        return MooncakeChunkStore.open(settings, memory.host_address, memory.host.nbytes)


BACKEND = MooncakeBackend()
