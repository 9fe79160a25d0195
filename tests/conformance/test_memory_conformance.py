"""The conformance suite run against the in-memory reference backends (proof that the suite runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import pytest

from kvcore.ids import ChunkKey
from kvcore.testing.index import ChunkIndexTests, chunk_index_state_machine
from kvcore.testing.memory import InMemoryChunkIndex


class MemoryIndexHarness:
    """An ``InMemoryChunkIndex`` whose keys are the tier's: presence is set on the index itself."""

    def __init__(self, capacity: int | None) -> None:
        self.backend = InMemoryChunkIndex(capacity)
        self.fail_next = self.backend.fail_next
        self.stall = self.backend.stall
        self.pin = self.backend.pin
        self.unpin = self.backend.unpin

    @property
    def capacity(self) -> int:
        return 8

    def make_present(self, keys: Sequence[ChunkKey]) -> None:
        self.backend.add(keys)

    def make_absent(self, keys: Sequence[ChunkKey]) -> None:
        self.backend.discard(keys)


@contextlib.contextmanager
def memory_index_harness() -> Iterator[MemoryIndexHarness]:
    yield MemoryIndexHarness(None)


class TestInMemoryChunkIndex(ChunkIndexTests[InMemoryChunkIndex]):
    @pytest.fixture
    def harness(self) -> Iterator[MemoryIndexHarness]:
        yield MemoryIndexHarness(8)


TestInMemoryChunkIndexMachine = chunk_index_state_machine(memory_index_harness).TestCase
