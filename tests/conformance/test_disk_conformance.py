"""The disk tier (``kvcore_disk``) through the conformance suite: its store and index over a temporary
directory, ``peek``/``poke`` and ``make_present``/``make_absent`` reading and writing the chunk files
themselves (``kvcore_disk.chunk_file``); failures and stalls injected through the store's fault hooks."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvcore.ids import ChunkKey
from kvcore.testing.faults import InjectedFaults
from kvcore.testing.index import ChunkIndexTests, chunk_index_state_machine
from kvcore.testing.store import ChunkStoreTests, chunk_store_state_machine
from kvcore_disk.chunk_file import ChunkHeader, file_bytes, header_bytes, write_temporary
from kvcore_disk.directory import ChunkDirectory
from kvcore_disk.index import DiskChunkIndex
from kvcore_disk.store import DiskChunkStore

HOST_SIZE = 128 * 1024
CAPACITY = 64 * 1024  # bytes of values: the suite's bound, filled by four values of a quarter of it
FILES_SIZE = CAPACITY + 4 * 1024  # the directory's size counts files: room for the headers of a few dozen
SETTLE_S = 0.5


def peek_file(directory: ChunkDirectory, key: ChunkKey) -> bytes | None:
    """The value of ``key``'s chunk file, read without the store; ``None`` if it has none."""
    path = directory.path(key)
    if not path.is_file():
        return None
    data = path.read_bytes()
    assert ChunkHeader.unpack(data).key == key
    return data[header_bytes(key) :]


def poke_file(directory: ChunkDirectory, key: ChunkKey, value: bytes) -> None:
    path = directory.file(key)
    directory.remove([path])
    directory.commit(
        write_temporary(path, key, [memoryview(value)], fsync=False), path, file_bytes(key, len(value))
    )


class DiskStoreHarness:
    def __init__(self, root: Path) -> None:
        self.directory = ChunkDirectory.open(root, FILES_SIZE)
        self._host = bytearray(HOST_SIZE)
        faults = InjectedFaults(stall_limit_s=SETTLE_S)
        self.backend = DiskChunkStore(self.directory, memoryview(self._host), faults=faults)
        self.host_size = HOST_SIZE
        self.capacity = CAPACITY
        self.fail_next = faults.fail_next
        self.stall = faults.stall
        self.pending_jobs = self.backend.pending_jobs

    def read_host(self, offset: int, length: int) -> bytes:
        return bytes(self._host[offset : offset + length])

    def write_host(self, offset: int, data: bytes) -> None:
        self._host[offset : offset + len(data)] = data

    def peek(self, key: ChunkKey) -> bytes | None:
        return peek_file(self.directory, key)

    def poke(self, key: ChunkKey, value: bytes) -> None:
        poke_file(self.directory, key, value)


class DiskIndexHarness:
    def __init__(self, root: Path) -> None:
        self.directory = ChunkDirectory.open(root, CAPACITY)
        self.backend = DiskChunkIndex(self.directory)

    def make_present(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            poke_file(self.directory, key, b"x")

    def make_absent(self, keys: Sequence[ChunkKey]) -> None:
        self.directory.remove([self.directory.path(key) for key in keys])


@contextlib.contextmanager
def disk_store_harness() -> Iterator[DiskStoreHarness]:
    with tempfile.TemporaryDirectory() as root:
        harness = DiskStoreHarness(Path(root))
        try:
            yield harness
        finally:
            harness.backend.close()


@contextlib.contextmanager
def disk_index_harness() -> Iterator[DiskIndexHarness]:
    with tempfile.TemporaryDirectory() as root:
        yield DiskIndexHarness(Path(root))


class TestDiskChunkStore(ChunkStoreTests[DiskChunkStore]):
    GATHERS_RUNS = True

    def make_harness(self) -> contextlib.AbstractContextManager[DiskStoreHarness]:
        return disk_store_harness()


class TestDiskChunkIndex(ChunkIndexTests[DiskChunkIndex]):
    def make_harness(self) -> contextlib.AbstractContextManager[DiskIndexHarness]:
        return disk_index_harness()


TestDiskChunkStoreMachine = chunk_store_state_machine(disk_store_harness).TestCase
TestDiskChunkIndexMachine = chunk_index_state_machine(disk_index_harness).TestCase
