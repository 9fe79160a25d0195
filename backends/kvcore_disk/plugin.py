"""The ``disk`` backend's registration (``kvcore.backends``): a local directory behind the host pool.
Importing it imports only the config class."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from kvcore.config import KVCoreConfig
from kvcore.errors import ConfigError
from kvcore.model.engine import EngineSpec
from kvcore.plugins import RemotePort, settings_of
from kvcore.ports import ChunkIndex, RankMemory
from kvcore_disk.config import DiskConfig

if TYPE_CHECKING:
    from kvcore.plugins.preflight import Finding, PreflightContext
    from kvcore_disk.directory import ChunkDirectory

__all__ = ["BACKEND", "DiskBackend"]


class DiskBackend:
    """The scheduler asks the directory which chunk files exist; each rank writes and reads its shard's
    files through its host pool. Both sides check the directory when they open."""

    kind = "disk"
    config_class = DiskConfig

    def preflight(self, config: KVCoreConfig, context: PreflightContext) -> Iterable[Finding]:
        """What ``open_*`` would refuse (``kvcore_disk.preflight``), found without opening anything."""
        from kvcore_disk.preflight import disk_findings

        return disk_findings(settings_of(config, DiskConfig), context)

    def open_index(self, config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
        _require_dependencies()
        from kvcore_disk.index import DiskChunkIndex

        return DiskChunkIndex(_directory(config))

    def open_remote(self, config: KVCoreConfig, engine: EngineSpec, memory: RankMemory) -> RemotePort | None:
        settings = settings_of(config, DiskConfig)
        _require_dependencies()
        if memory.host is None:
            raise ConfigError(f"backend.{settings.HOST_FIELD}", 0, "a host pool to stage the chunk files")
        from kvcore_disk.store import DiskChunkStore

        return DiskChunkStore(
            _directory(config), memory.host, fsync=settings.fsync, io_threads=settings.io_threads
        )


def _require_dependencies() -> None:
    """Refuse, naming what to install, when the file digests' library (an extra of kvcore) is missing."""
    try:
        import xxhash  # noqa: F401
    except ModuleNotFoundError as exc:
        expected = f"the disk tier's dependencies installed ({exc}): pip install 'kvcore[disk]'"
        raise ConfigError("backend.kind", "disk", expected) from exc


def _directory(config: KVCoreConfig) -> ChunkDirectory:
    from kvcore_disk.directory import ChunkDirectory

    settings = settings_of(config, DiskConfig)
    return ChunkDirectory.open(Path(settings.path), settings.size)


BACKEND = DiskBackend()
