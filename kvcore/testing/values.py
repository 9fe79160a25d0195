"""What the store and managed-tier suites share: the harness of a tier over a host buffer
(``StoreHarness``), and the helpers that stage values in the host buffer and read them back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from kvcore.ids import ChunkKey
from kvcore.ports import JobQueue, StoreItem
from kvcore.testing.support import payload

__all__ = ["StoreHarness", "held_bytes", "read_items", "scribble", "stage", "values_for"]

QueueT_co = TypeVar("QueueT_co", bound=JobQueue, covariant=True)


class StoreHarness(Protocol[QueueT_co]):
    """A tier over a host buffer (a ``ChunkStore`` or a ``ManagedTier``), with out-of-band access.

    The suites need ``host_size`` >= 16 KiB and, for a bounded tier, ``capacity`` >= 4 KiB with
    ``host_size`` >= 2 x ``capacity``.
    """

    @property
    def backend(self) -> QueueT_co: ...

    @property
    def host_size(self) -> int:
        """Bytes of the host buffer registered with the backend; ``StoreItem`` offsets index it."""
        ...

    def read_host(self, offset: int, length: int) -> bytes: ...

    def write_host(self, offset: int, data: bytes) -> None: ...

    def peek(self, key: ChunkKey) -> bytes | None:
        """The value the tier holds under ``key``, read without the backend; ``None`` if absent."""
        ...

    def poke(self, key: ChunkKey, value: bytes) -> None:
        """Make the tier hold ``value`` under ``key``, written without the backend."""
        ...


def stage(
    harness: StoreHarness[JobQueue], values: Mapping[ChunkKey, bytes], base: int = 0
) -> list[StoreItem]:
    """Write ``values`` one after another into the host buffer from ``base``; their items."""
    items = []
    for key, value in values.items():
        items.append(StoreItem(key, base, len(value)))
        harness.write_host(base, value)
        base += len(value)
    return items


def read_items(harness: StoreHarness[JobQueue], items: Sequence[StoreItem]) -> list[bytes]:
    """The host bytes of each item."""
    return [harness.read_host(item.offset, item.length) for item in items]


def scribble(harness: StoreHarness[JobQueue], items: Sequence[StoreItem]) -> None:
    """Overwrite the items' host bytes, so that a get that copies nothing shows."""
    for item in items:
        harness.write_host(item.offset, payload(item.length, ("scribble", item)))


def values_for(keys: Sequence[ChunkKey], *sizes: int) -> dict[ChunkKey, bytes]:
    """Random values of the given sizes (cycled) for ``keys``."""
    return {key: payload(sizes[i % len(sizes)], key) for i, key in enumerate(keys)}


def held_bytes(harness: StoreHarness[JobQueue], keys: Sequence[ChunkKey]) -> int:
    return sum(len(v) for k in keys if (v := harness.peek(k)) is not None)
