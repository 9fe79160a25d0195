"""The scheduler side: a ``ChunkIndex`` that answers from the files, at once."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from kvcore.errors import BackendUnavailable, UsageError
from kvcore.ids import ChunkKey, LookupId
from kvcore.kit.leading import leading_chunks
from kvcore_dirstore.files import chunk_path

__all__ = ["DirChunkIndex"]


class DirChunkIndex:
    """Counts the leading chunks whose every shard has a file under ``root`` (``SupportsImmediateLookup``
    too: a stat per key is cheap enough to answer in the scheduler's step)."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._ids = itertools.count(1)
        self._answers: dict[LookupId, int] = {}
        self._closed = False
        root.mkdir(parents=True, exist_ok=True)

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        return leading_chunks(chunks, lambda shards: all(chunk_path(self._root, k).is_file() for k in shards))

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        self._check_open()
        lookup_id = LookupId(next(self._ids))
        self._answers[lookup_id] = self.lookup(chunks)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        self._check_open()
        if lookup_id not in self._answers:
            raise UsageError(f"lookup {lookup_id} is unknown, cancelled or already answered")
        return self._answers.pop(lookup_id)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        self._answers.pop(lookup_id, None)

    def close(self) -> None:
        """Answer no more lookups (the files stay)."""
        self._closed = True
        self._answers.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the dirstore index is closed")
