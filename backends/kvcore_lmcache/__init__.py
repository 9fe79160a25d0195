"""kvcore's tier on a standalone LMCache multiprocess server (``lmcache server``, lmcache 0.5.6).

``LMCacheManagedTier`` (worker side) implements the ``ManagedTier`` port over the server's
engine-driven shared-memory slots; ``LMCacheChunkIndex`` (scheduler side) answers ``ChunkIndex``
lookups, and keeps the read locks a load hands to the workers (``SupportsHeldLookups``). Both keep
working while the server is absent, hung, restarting or without a shared-memory pool
(``NoSharedMemoryPool``, said once in a warning): they miss, and rejoin when it answers again. See
``docs/lmcache.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from kvcore_lmcache.index import LMCacheChunkIndex
    from kvcore_lmcache.link import NoSharedMemoryPool, ServerLink, SlotLayout
    from kvcore_lmcache.tier import LMCacheManagedTier

__all__ = ["LMCacheChunkIndex", "LMCacheManagedTier", "NoSharedMemoryPool", "ServerLink", "SlotLayout"]

__getattr__ = lazy_exports(
    __name__,
    {
        "LMCacheChunkIndex": "kvcore_lmcache.index",
        "NoSharedMemoryPool": "kvcore_lmcache.link",
        "ServerLink": "kvcore_lmcache.link",
        "SlotLayout": "kvcore_lmcache.link",
        "LMCacheManagedTier": "kvcore_lmcache.tier",
    },
)
