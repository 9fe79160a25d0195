"""``DiskChunkIndex``: the ``ChunkIndex`` port on a disk tier's directory, for the scheduler.

It keeps nothing in memory: the directory is the index, shared with every process that writes to it (the
engine's ranks, other engines on the host), so a lookup asks the file system whether each shard's chunk file
exists. A ``stat`` of a name costs a few microseconds, so it answers at once (``SupportsImmediateLookup``;
``kvcore.kit.immediate_index`` answers its submitted lookups when polled). A file found here that turns out
damaged fails its read: the blocks are recomputed and the file removed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvcore.ids import ChunkKey
from kvcore.kit.immediate_index import ImmediateIndex
from kvcore.kit.leading import leading_chunks
from kvcore.ports import TierUsage
from kvcore_disk.directory import ChunkDirectory

__all__ = ["DiskChunkIndex"]


class DiskChunkIndex(ImmediateIndex):
    """How many leading chunks have a chunk file for every shard in ``directory``."""

    def __init__(self, directory: ChunkDirectory) -> None:
        super().__init__("the disk tier's index")
        self._directory = directory

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        self._check_open()
        file, isfile = self._directory.file, os.path.isfile
        return leading_chunks(chunks, lambda shards: all(isfile(file(key)) for key in shards))

    def usage(self) -> TierUsage:
        """``SupportsTierUsage``: the directory's bytes in use, its size, and its evictions (every
        process's), from its lock file."""
        used, evictions = self._directory.counts()
        return TierUsage(used, self._directory.size, evictions)
