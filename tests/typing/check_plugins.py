"""Checked by mypy, never run: every registered plugin satisfies its protocol, its config class
``BackendSettings``, and the out-of-tree example's ports are the ports."""

from __future__ import annotations

from pathlib import Path

from kvcore.kit.settings import BackendSettings
from kvcore.plugins import Backend, EngineMemory
from kvcore.ports import ChunkIndex, ChunkStore, SupportsImmediateLookup
from kvcore_cpu.config import CPUBackendConfig
from kvcore_cpu.plugin import BACKEND as CPU
from kvcore_cpu.plugin import TORCH
from kvcore_dirstore import BACKEND as DIRSTORE
from kvcore_dirstore import DirChunkIndex, DirChunkStore, DirStoreConfig
from kvcore_lmcache.config import LMCacheMPConfig
from kvcore_lmcache.plugin import BACKEND as LMCACHE
from kvcore_mooncake.config import MooncakeStoreConfig
from kvcore_mooncake.plugin import BACKEND as MOONCAKE


def check(root: Path, host: memoryview) -> None:
    backends: list[Backend] = [CPU, MOONCAKE, LMCACHE, DIRSTORE]
    memory: EngineMemory = TORCH
    settings: list[type[BackendSettings]] = [
        CPUBackendConfig,
        MooncakeStoreConfig,
        LMCacheMPConfig,
        DirStoreConfig,
    ]
    store: ChunkStore = DirChunkStore(root, host)
    index: ChunkIndex = DirChunkIndex(root)
    immediate: SupportsImmediateLookup = DirChunkIndex(root)
    del backends, memory, settings, store, index, immediate
