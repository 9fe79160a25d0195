"""The answer of every index: how many leading chunks a tier holds, a chunk counting only when every one
of its shards is there, and no chunk after a missing one counting, whatever it holds (a hit is a prefix).
One function for every index (the pool's, a disk's, a store's batch answer, the references'), so that
they cannot answer differently."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

__all__ = ["by_chunk", "leading_chunks"]

Chunk = TypeVar("Chunk")
Item = TypeVar("Item")


def leading_chunks(chunks: Iterable[Chunk], complete: Callable[[Chunk], bool]) -> int:
    """How many of ``chunks``, from the first, are ``complete`` (every shard present); it stops at the
    first that is not, asking nothing of the chunks after it."""
    count = 0
    for chunk in chunks:
        if not complete(chunk):
            break
        count += 1
    return count


def by_chunk(flat: Sequence[Item], sizes: Iterable[int]) -> Iterator[Sequence[Item]]:
    """The per-chunk slices of a chunk-major ``flat`` answer (a store's one flag per key, its chunks'
    shards one after another), chunk ``i`` having ``sizes[i]`` shards."""
    start = 0
    for size in sizes:
        yield flat[start : start + size]
        start += size
