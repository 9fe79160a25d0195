"""kvcore-dirstore: KV chunks as files in a directory, an out-of-tree kvcore backend.

The distribution registers ``BACKEND`` under the entry-point group ``kvcore.backends`` as ``dirstore``
(see ``pyproject.toml``); kvcore then structures ``{"backend": {"kind": "dirstore", ...}}`` with
``DirStoreConfig`` and opens the two sides below for every engine. Written by following
docs/writing-a-backend.md alone.
"""

from __future__ import annotations

from pathlib import Path

from kvcore.config import KVCoreConfig
from kvcore.errors import ConfigError
from kvcore.model.engine import EngineSpec
from kvcore.plugins import RemotePort, settings_of
from kvcore.ports import ChunkIndex, RankMemory
from kvcore_dirstore.config import DirStoreConfig
from kvcore_dirstore.index import DirChunkIndex
from kvcore_dirstore.store import DirChunkStore

__all__ = ["BACKEND", "DirChunkIndex", "DirChunkStore", "DirStoreBackend", "DirStoreConfig"]


class DirStoreBackend:
    """The ``kvcore.plugins.Backend`` of kind ``dirstore``."""

    kind = "dirstore"
    config_class = DirStoreConfig

    def open_index(self, config: KVCoreConfig, engine: EngineSpec) -> ChunkIndex | None:
        return DirChunkIndex(_root(config))

    def open_remote(self, config: KVCoreConfig, engine: EngineSpec, memory: RankMemory) -> RemotePort | None:
        """The rank's ``ChunkStore``: kvcore makes it the worker's remote tier."""
        if memory.host is None:
            raise ConfigError("backend.local_size", 0, "a host pool to stage the files' chunks")
        return DirChunkStore(_root(config), memory.host)


def _root(config: KVCoreConfig) -> Path:
    return Path(settings_of(config, DirStoreConfig).path)


BACKEND = DirStoreBackend()
