"""The scheduler side: a ``ChunkIndex`` that answers from the files, at once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvcore.ids import ChunkKey
from kvcore.kit.immediate_index import ImmediateIndex
from kvcore.kit.leading import leading_chunks
from kvcore_dirstore.files import chunk_path

__all__ = ["DirChunkIndex"]


class DirChunkIndex(ImmediateIndex):
    """Counts the leading chunks whose every shard has a file under ``root``. A stat per key is cheap
    enough to answer in the scheduler's step (``SupportsImmediateLookup``); the kit's ``ImmediateIndex``
    answers the submitted form, and refuses what the port says it must (an unknown id, a closed index)."""

    def __init__(self, root: Path) -> None:
        super().__init__("the dirstore index")
        self._root = root
        root.mkdir(parents=True, exist_ok=True)

    def lookup(self, chunks: Sequence[Sequence[ChunkKey]]) -> int:
        return leading_chunks(chunks, lambda shards: all(chunk_path(self._root, k).is_file() for k in shards))
