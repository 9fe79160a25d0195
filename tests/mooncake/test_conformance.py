"""The conformance suite run against the Mooncake store and index, on a real ``mooncake_master``.

Two clients per store test: the store under test, and a raw client that reads and writes values out of
band (``peek``/``poke``) so that the store itself is what is tested. ``TestStoreOnHolder`` runs the store
as a pure client whose values live in the raw client's segment (an engine worker next to a segment
holder); ``TestStoreOwnSegment`` lets the store's own client hold the segment. Failures and stalls are
injected through the store's and the index's fault hooks (``kvcore.testing.faults.InjectedFaults``),
each stall bounded: the store calls its hooks under the lock that ``clear`` waits for.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator, Sequence
from typing import ClassVar

import attrs
import pytest
from mooncake.store import MooncakeDistributedStore

from kvcore.ids import ChunkKey
from kvcore.testing.faults import InjectedFaults
from kvcore.testing.index import ChunkIndexTests, chunk_index_state_machine
from kvcore.testing.store import ChunkStoreTests, chunk_store_state_machine
from kvcore.testing.support import SETTLE_S
from kvcore_mooncake import MooncakeChunkIndex, MooncakeChunkStore, MooncakeClient
from kvcore_mooncake.client import Code
from tests.frozen import frozen
from tests.mooncake.conftest import Master, Masters, MiB, config_for

HOST_BYTES = 64 << 10


def raw_client(master: Master, segment_size: int) -> MooncakeDistributedStore:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    native = MooncakeDistributedStore()
    code = native.setup("127.0.0.1", "P2PHANDSHAKE", segment_size, 16 * MiB, "tcp", "", master.address)
    assert code == 0, f"raw client setup failed with {code}"
    return native


class HostBuffer:
    """Host memory for a store, by address (ctypes): what a worker's host tier would hand over."""

    def __init__(self, length: int) -> None:
        self._memory = ctypes.create_string_buffer(length)
        self.address = ctypes.addressof(self._memory)
        self.length = length

    def read(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.address + offset, length)

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.address + offset, data, len(data))


@attrs.frozen
class Pool:
    """What outlives one test: the master, a raw client for peek/poke, the store's client and buffer.

    Clients are shared because closing one takes Mooncake 1-2 s; each test still gets a fresh store.
    """

    master: Master
    raw: MooncakeDistributedStore
    client: MooncakeClient
    buffer: HostBuffer


@pytest.fixture(scope="module")
def master(_masters: Masters) -> Iterator[Master]:
    """The module's own master (the suite's shared one, overridden): the outage checks freeze it for
    seconds, and a master thawed after more than its ``client_ttl`` expires every client it did not hear
    from (their segments and keys go: the suite's 2 s did under load); 30 s outlasts any freeze here."""
    own = _masters.new(("--client_ttl=30",))
    own.start()
    yield own
    own.stop()


@contextlib.contextmanager
def open_pool(master: Master, store_segment: int) -> Iterator[Pool]:
    raw = raw_client(master, 0 if store_segment else 64 * MiB)
    client = MooncakeClient.connect(config_for(master.address, store_segment))
    try:
        yield Pool(master, raw, client, HostBuffer(HOST_BYTES))
    finally:
        client.close()
        raw.close()


def stopped(master: Master) -> contextlib.AbstractContextManager[None]:
    """The master frozen while inside (``tests.frozen``), thawed on exit holding what it held."""
    assert master.process is not None
    return frozen(master.process.pid)


class MooncakeStoreHarness:
    """A fresh store on the pool's client, with peek/poke through the pool's raw client."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self.outage = functools.partial(stopped, pool.master)
        faults = InjectedFaults(stall_limit_s=SETTLE_S)
        self.backend = MooncakeChunkStore(
            pool.client, pool.buffer.address, pool.buffer.length, remove_timeout_s=2.0, faults=faults
        )
        self.host_size = pool.buffer.length
        self.read_host = pool.buffer.read
        self.write_host = pool.buffer.write
        self.fail_next = faults.fail_next
        self.stall = faults.stall
        self.pending_jobs = self.backend.pending_jobs

    def peek(self, key: ChunkKey) -> bytes | None:
        # every conformance value has at least one byte: an empty answer is a missing key
        return self._pool.raw.get(key) or None

    def poke(self, key: ChunkKey, value: bytes) -> None:
        assert self._pool.raw.upsert(key, value) == 0

    def close(self) -> None:
        self.backend.close()


class _StoreSuite(ChunkStoreTests[MooncakeChunkStore]):
    GATHERS_RUNS = True

    own_segment: ClassVar[bool]

    @pytest.fixture(scope="class")
    @classmethod
    def pool(cls, master: Master) -> Iterator[Pool]:
        with open_pool(master, 64 * MiB if cls.own_segment else 0) as pool:
            yield pool

    @pytest.fixture
    def harness(self, pool: Pool) -> Iterator[MooncakeStoreHarness]:
        with contextlib.closing(MooncakeStoreHarness(pool)) as harness:
            yield harness


class TestStoreOnHolder(_StoreSuite):
    """The store is a pure client; values live in another client's segment."""

    own_segment = False


class TestStoreOwnSegment(_StoreSuite):
    """The store's client holds the segment itself."""

    own_segment = True


# -- the index -----------------------------------------------------------------------------------------


class MooncakeIndexHarness:
    """An index on a pure client; presence changed through a raw client that holds the segment."""

    def __init__(self, pool: Pool) -> None:
        self._raw = pool.raw
        self.outage = functools.partial(stopped, pool.master)
        faults = InjectedFaults(stall_limit_s=SETTLE_S)
        self.backend = MooncakeChunkIndex(pool.client, timeout_s=2.0, faults=faults)
        self.fail_next = faults.fail_next
        self.stall = faults.stall

    def make_present(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            assert self._raw.upsert(key, b"x") == 0

    def make_absent(self, keys: Sequence[ChunkKey]) -> None:
        codes = self._raw.batch_remove(list(keys), True)
        assert all(c in (0, Code.NOT_FOUND) for c in codes), codes

    def close(self) -> None:
        self.backend.close()


@pytest.fixture(scope="module")
def shared_pool(master: Master) -> Iterator[Pool]:
    """A pool whose raw client holds the segment, for the index tests and the state machines."""
    with open_pool(master, 0) as pool:
        yield pool


class TestIndex(ChunkIndexTests[MooncakeChunkIndex]):
    @pytest.fixture
    def harness(self, shared_pool: Pool) -> Iterator[MooncakeIndexHarness]:
        with contextlib.closing(MooncakeIndexHarness(shared_pool)) as harness:
            yield harness


# -- state machines: fixtures cannot reach a unittest-style case, so an autouse fixture hands them the pool


_POOL: list[Pool] = []


@pytest.fixture(autouse=True, scope="module")
def _pool_for_machines(shared_pool: Pool) -> Iterator[None]:
    _POOL.append(shared_pool)
    yield
    _POOL.clear()


@contextlib.contextmanager
def _machine_store() -> Iterator[MooncakeStoreHarness]:
    with contextlib.closing(MooncakeStoreHarness(_POOL[0])) as harness:
        yield harness


@contextlib.contextmanager
def _machine_index() -> Iterator[MooncakeIndexHarness]:
    with contextlib.closing(MooncakeIndexHarness(_POOL[0])) as harness:
        yield harness


TestStoreMachine = chunk_store_state_machine(_machine_store, max_examples=8, steps=20).TestCase
TestIndexMachine = chunk_index_state_machine(_machine_index, max_examples=8, steps=20).TestCase
