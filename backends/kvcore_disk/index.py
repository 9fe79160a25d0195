"""``DiskChunkIndex``: the ``ChunkIndex`` port on a disk tier's directory, for the scheduler.

It keeps nothing in memory: the directory is the index, shared with every process that writes to it
(the engine's ranks, other engines on the host), so a lookup asks the file system whether each shard's
chunk file exists. A ``stat`` of a name costs a few microseconds, so it answers at once
(``SupportsImmediateLookup``) and ``submit_lookup`` is answered by its first ``poll_lookup``. A file
found here that turns out damaged fails its read: the blocks are recomputed and the file removed.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

from kvcore.errors import BackendUnavailable
from kvcore.ids import ChunkKey, LookupId
from kvcore.ports import TierUsage
from kvcore_disk.directory import ChunkDirectory

__all__ = ["DiskChunkIndex"]


class DiskChunkIndex:
    """How many leading chunks have a chunk file for every shard in ``directory``."""

    def __init__(self, directory: ChunkDirectory) -> None:
        self._directory = directory
        self._ids = itertools.count(1)
        self._answers: dict[LookupId, int] = {}
        self._closed = False

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        self._check_open()
        file, isfile = self._directory.file, os.path.isfile
        hits = 0
        for shards in chunks:
            if not all(isfile(file(key)) for key in shards):
                break
            hits += 1
        return hits

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        lookup_id = LookupId(next(self._ids))
        self._answers[lookup_id] = self.lookup(chunks)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        self._check_open()
        return self._answers.pop(lookup_id, 0)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        self._answers.pop(lookup_id, None)

    def usage(self) -> TierUsage:
        """``SupportsTierUsage``: the directory's bytes in use, its size, and its evictions (every
        process's), from its lock file."""
        used, evictions = self._directory.counts()
        return TierUsage(used, self._directory.size, evictions)

    def close(self) -> None:
        """Answer no more lookups; the files stay."""
        self._closed = True
        self._answers.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the disk tier's index is closed")
