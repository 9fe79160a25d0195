"""The Mooncake store backend: a distributed KV pool shared by engine instances.

``MooncakeChunkStore`` (worker side, the ``ChunkStore`` port) moves chunks between a registered host
buffer and the pool; ``MooncakeChunkIndex`` (scheduler side, the ``ChunkIndex`` port) asks the master
which chunks exist, from a pure client that holds no data. ``MooncakeClient`` is the guarded native
client both use; ``python -m kvcore_mooncake.holder`` runs a segment holder so that a pool outlives
engine restarts. See ``docs/mooncake-store.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from kvcore_mooncake.client import MooncakeClient
    from kvcore_mooncake.index import MooncakeChunkIndex
    from kvcore_mooncake.store import MooncakeChunkStore

__all__ = ["MooncakeChunkIndex", "MooncakeChunkStore", "MooncakeClient"]

__getattr__ = lazy_exports(
    __name__,
    {
        "MooncakeClient": "kvcore_mooncake.client",
        "MooncakeChunkIndex": "kvcore_mooncake.index",
        "MooncakeChunkStore": "kvcore_mooncake.store",
    },
)
