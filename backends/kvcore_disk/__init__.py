"""The disk tier: KV chunks as files in a local directory, behind the host pool, surviving restarts.

``DiskChunkStore`` (worker side, the ``ChunkStore`` port) writes and reads chunk files between the rank's
host pool and the directory; ``DiskChunkIndex`` (scheduler side, the ``ChunkIndex`` port) asks the
directory which chunks it holds; ``ChunkDirectory`` is the shared folder itself (its checks, the bytes in
use, LRU eviction). See ``docs/disk.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore.kit.lazy import lazy_exports

if TYPE_CHECKING:
    from kvcore_disk.directory import ChunkDirectory
    from kvcore_disk.index import DiskChunkIndex
    from kvcore_disk.store import DiskChunkStore

__all__ = ["ChunkDirectory", "DiskChunkIndex", "DiskChunkStore"]

__getattr__ = lazy_exports(
    __name__,
    {
        "ChunkDirectory": "kvcore_disk.directory",
        "DiskChunkIndex": "kvcore_disk.index",
        "DiskChunkStore": "kvcore_disk.store",
    },
)
