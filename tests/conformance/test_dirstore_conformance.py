"""The out-of-tree example backend (docs/examples/dirstore) through the conformance suite, as its author
would run it: the store and the index over a temporary directory, with ``peek``/``poke`` and
``make_present``/``make_absent`` reading and writing the files themselves."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvcore.ids import ChunkKey
from kvcore.testing.faults import InjectedFaults
from kvcore.testing.index import ChunkIndexTests, chunk_index_state_machine
from kvcore.testing.store import ChunkStoreTests, chunk_store_state_machine
from kvcore.testing.support import SETTLE_S
from kvcore_dirstore.files import chunk_path, write_atomically
from kvcore_dirstore.index import DirChunkIndex
from kvcore_dirstore.store import DirChunkStore

HOST_SIZE = 16 * 1024


class DirStoreHarness:
    """Declares failure injection and stalls (through the store's fault hooks), and counts its jobs."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._host = bytearray(HOST_SIZE)
        faults = InjectedFaults(stall_limit_s=SETTLE_S)
        self.backend = DirChunkStore(root, memoryview(self._host), faults=faults)
        self.host_size = HOST_SIZE
        self.fail_next = faults.fail_next
        self.stall = faults.stall
        self.pending_jobs = self.backend.pending_jobs

    def read_host(self, offset: int, length: int) -> bytes:
        return bytes(self._host[offset : offset + length])

    def write_host(self, offset: int, data: bytes) -> None:
        self._host[offset : offset + len(data)] = data

    def peek(self, key: ChunkKey) -> bytes | None:
        path = chunk_path(self._root, key)
        return path.read_bytes() if path.is_file() else None

    def poke(self, key: ChunkKey, value: bytes) -> None:
        write_atomically(chunk_path(self._root, key), value)


class DirIndexHarness:
    def __init__(self, root: Path) -> None:
        self._root = root
        self.backend = DirChunkIndex(root)

    def make_present(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            write_atomically(chunk_path(self._root, key), b"x")

    def make_absent(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            chunk_path(self._root, key).unlink(missing_ok=True)


@contextlib.contextmanager
def dir_store_harness() -> Iterator[DirStoreHarness]:
    with tempfile.TemporaryDirectory() as root:
        yield DirStoreHarness(Path(root))


@contextlib.contextmanager
def dir_index_harness() -> Iterator[DirIndexHarness]:
    with tempfile.TemporaryDirectory() as root:
        yield DirIndexHarness(Path(root))


class TestDirChunkStore(ChunkStoreTests[DirChunkStore]):
    def make_harness(self) -> contextlib.AbstractContextManager[DirStoreHarness]:
        return dir_store_harness()


class TestDirChunkIndex(ChunkIndexTests[DirChunkIndex]):
    def make_harness(self) -> contextlib.AbstractContextManager[DirIndexHarness]:
        return dir_index_harness()


TestDirChunkStoreMachine = chunk_store_state_machine(dir_store_harness).TestCase
TestDirChunkIndexMachine = chunk_index_state_machine(dir_index_harness).TestCase
