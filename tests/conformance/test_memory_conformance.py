"""The conformance suite run against the in-memory reference backends: proof that the suite runs.

Each harness hands the suite a fresh backend and the out-of-band hooks that bypass it; the test hooks
(``fail_next``, ``stall``, ``capacity``, ``pin``) are the reference backends' own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

import pytest

from kvcore.ids import ChunkKey
from kvcore.ports import MemoryRegion
from kvcore.testing.blocks import BlockTransferTests
from kvcore.testing.index import ChunkIndexTests, chunk_index_state_machine
from kvcore.testing.managed import ManagedTierTests
from kvcore.testing.memory import (
    InMemoryAddressSpace,
    InMemoryBlockMover,
    InMemoryBlockTransferTier,
    InMemoryChunkIndex,
    InMemoryChunkStore,
    InMemoryManagedTier,
    InMemoryPeerTransport,
    InMemoryStoreIndex,
)
from kvcore.testing.mover import BlockMoverTests
from kvcore.testing.ordered import OrderedMoverTests
from kvcore.testing.peer import PeerTransportTests
from kvcore.testing.store import ChunkStoreTests, chunk_store_state_machine
from kvcore.testing.support import require_stall

INDEX_CAPACITY = 8  # keys
STORE_CAPACITY = 4096  # bytes
HOST_SIZE = 16 * 1024  # bytes

BLOCKS_PER_CHUNK = 2

TierT = TypeVar("TierT", InMemoryChunkStore, InMemoryManagedTier, InMemoryBlockTransferTier)


class MemoryIndexHarness:
    """The index's keys are the tier's: presence is set on the index itself. ``index_class`` may be a
    variant of the reference (``tests/conformance/mutants.py``)."""

    def __init__(self, capacity: int, index_class: type[InMemoryChunkIndex] = InMemoryChunkIndex) -> None:
        self.backend = index_class(capacity)
        self.capacity = capacity
        self.fail_next = self.backend.fail_next
        self.stall = self.backend.stall
        self.outage = self.backend.outage
        self.pin = self.backend.pin
        self.unpin = self.backend.unpin

    def make_present(self, keys: Sequence[ChunkKey]) -> None:
        self.backend.add(keys)

    def make_absent(self, keys: Sequence[ChunkKey]) -> None:
        self.backend.discard(keys)


class StoreIndexHarness:
    """The index of a store that answers from the store: presence is set in the store, and the store's
    server going away takes the index's answers with it."""

    def __init__(self) -> None:
        self.store = InMemoryChunkStore(bytearray(HOST_SIZE))
        self.backend = InMemoryStoreIndex(self.store.exists)
        self.fail_next = self.backend.fail_next
        self.stall = self.backend.stall
        self.outage = self.store.outage

    def make_present(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            self.store.poke(key, b"v")

    def make_absent(self, keys: Sequence[ChunkKey]) -> None:
        self.store.remove(keys)


def new_mover() -> InMemoryBlockMover:
    return InMemoryBlockMover(num_engine_blocks=12, num_host_blocks=16, layer_block_bytes=32, num_layers=3)


class MemoryMoverHarness:
    def __init__(self) -> None:
        self.backend = new_mover()
        self.num_engine_blocks = self.backend.num_engine_blocks
        self.num_host_blocks = self.backend.num_host_blocks
        self.block_bytes = self.backend.host_block_bytes
        self.read_engine_block = self.backend.read_engine_block
        self.write_engine_block = self.backend.write_engine_block
        self.read_host_block = self.backend.read_host_block
        self.write_host_block = self.backend.write_host_block
        self.fail_next = self.backend.fail_next
        self.stall = self.backend.stall


class MemoryTierHarness(Generic[TierT]):
    """A store or managed tier over a host ``bytearray``; ``peek``/``poke`` are the backend's own, and
    ignore the chain (``preceding``): the reference backends key chunks alone."""

    def __init__(self, backend: TierT, host: bytearray, capacity: int) -> None:
        self.backend: TierT = backend
        self.host_size = len(host)
        self.capacity = capacity
        self._host = host
        self.fail_next = backend.fail_next
        self.stall = backend.stall
        self.pending_jobs = backend.pending_jobs

    def peek(self, key: ChunkKey, preceding: Sequence[ChunkKey] = ()) -> bytes | None:
        return self.backend.peek(key)

    def poke(self, key: ChunkKey, value: bytes, preceding: Sequence[ChunkKey] = ()) -> None:
        self.backend.poke(key, value)

    def read_host(self, offset: int, length: int) -> bytes:
        return bytes(self._host[offset : offset + length])

    def write_host(self, offset: int, data: bytes) -> None:
        self._host[offset : offset + len(data)] = data


class MemoryBlockTierHarness(MemoryTierHarness[InMemoryBlockTransferTier]):
    """A managed tier over a host ``bytearray`` that also copies the engine blocks of a mover of its own
    (whose host blocks go unused)."""

    def __init__(self) -> None:
        host = bytearray(HOST_SIZE)
        engine = new_mover()
        tier = InMemoryBlockTransferTier(
            host, STORE_CAPACITY, engine=engine, blocks_per_chunk=BLOCKS_PER_CHUNK
        )
        super().__init__(tier, host, STORE_CAPACITY)
        self.num_engine_blocks = engine.num_engine_blocks
        self.block_bytes = engine.host_block_bytes
        self.blocks_per_chunk = BLOCKS_PER_CHUNK
        self.read_engine_block = engine.read_engine_block
        self.write_engine_block = engine.write_engine_block


class MemoryPeerHarness:
    """Two transports on one address space; the producer's memory needs no registration."""

    def __init__(self) -> None:
        self.space = InMemoryAddressSpace()
        self.producer = InMemoryPeerTransport(self.space, "prefill-0")
        self.consumer = InMemoryPeerTransport(self.space, "decode-0")
        self.consumer_name = self.consumer.address
        self.write_memory = self.space.write
        self.read_memory = self.space.read
        self.fail_next = self.producer.fail_next
        self.stall = self.producer.stall

    def allocate_local(self, length: int) -> int:
        return self.space.allocate(length).address

    def allocate_remote(self, length: int) -> MemoryRegion:
        return self.space.allocate(length)


class MemoryStoreHarness(MemoryTierHarness[InMemoryChunkStore]):
    """The store, whose client ``outage`` cuts off its (simulated) server."""

    def __init__(self, store_class: type[InMemoryChunkStore] = InMemoryChunkStore) -> None:
        host = bytearray(HOST_SIZE)
        super().__init__(store_class(host, STORE_CAPACITY), host, STORE_CAPACITY)
        self.outage = self.backend.outage


@contextlib.contextmanager
def memory_index_harness(
    capacity: int = INDEX_CAPACITY, index_class: type[InMemoryChunkIndex] = InMemoryChunkIndex
) -> Iterator[MemoryIndexHarness]:
    yield MemoryIndexHarness(capacity, index_class)


@contextlib.contextmanager
def memory_store_harness(
    store_class: type[InMemoryChunkStore] = InMemoryChunkStore,
) -> Iterator[MemoryStoreHarness]:
    yield MemoryStoreHarness(store_class)


@contextlib.contextmanager
def store_index_harness() -> Iterator[StoreIndexHarness]:
    yield StoreIndexHarness()


class TestInMemoryStoreIndex(ChunkIndexTests[InMemoryStoreIndex]):
    def make_harness(self) -> contextlib.AbstractContextManager[StoreIndexHarness]:
        return store_index_harness()

    def test_it_answers_from_the_store_as_it_is_when_polled(self, harness: StoreIndexHarness) -> None:
        key = ChunkKey("late")
        lookup_id = harness.backend.submit_lookup([[key]])
        harness.make_present([key])
        assert harness.backend.poll_lookup(lookup_id) == 1
        assert harness.backend.asked == [(((key,),), ())]


class TestInMemoryChunkIndex(ChunkIndexTests[InMemoryChunkIndex]):
    def make_harness(self) -> contextlib.AbstractContextManager[MemoryIndexHarness]:
        return memory_index_harness()

    def test_full_index_evicts_the_least_recently_added_key(self, harness: MemoryIndexHarness) -> None:
        # capacity 8: add k0..k7, re-add k0, add k8 -> evicts k1
        keys = [ChunkKey(f"k{i}") for i in range(9)]
        harness.backend.add(keys[:8])
        harness.backend.add(keys[:1])
        harness.backend.add(keys[8:])
        assert [k for k in keys if k not in harness.backend] == [keys[1]]

    def test_full_index_of_pinned_keys_refuses_new_ones(self, harness: MemoryIndexHarness) -> None:
        keys = [ChunkKey(f"k{i}") for i in range(9)]
        harness.backend.add(keys[:8])
        harness.backend.pin(keys[:8])
        assert harness.backend.add(keys[8:]) == (False,)
        assert len(harness.backend) == 8


class TestInMemoryBlockMover(BlockMoverTests[InMemoryBlockMover], OrderedMoverTests[InMemoryBlockMover]):
    def make_harness(self) -> contextlib.AbstractContextManager[MemoryMoverHarness]:
        return contextlib.nullcontext(MemoryMoverHarness())


class TestInMemoryChunkStore(ChunkStoreTests[InMemoryChunkStore]):
    GATHERS_RUNS = True

    def make_harness(self) -> contextlib.AbstractContextManager[MemoryStoreHarness]:
        return memory_store_harness()


class TestInMemoryManagedTier(ManagedTierTests[InMemoryManagedTier]):
    def make_harness(self) -> contextlib.AbstractContextManager[MemoryTierHarness[InMemoryManagedTier]]:
        host = bytearray(HOST_SIZE)
        tier = InMemoryManagedTier(host, STORE_CAPACITY)
        return contextlib.nullcontext(MemoryTierHarness(tier, host, STORE_CAPACITY))


class TestInMemoryBlockTransferTier(
    ManagedTierTests[InMemoryBlockTransferTier], BlockTransferTests[InMemoryBlockTransferTier]
):
    def make_harness(self) -> contextlib.AbstractContextManager[MemoryBlockTierHarness]:
        return contextlib.nullcontext(MemoryBlockTierHarness())


class TestInMemoryPeerTransport(PeerTransportTests[InMemoryPeerTransport]):
    def make_harness(self) -> contextlib.AbstractContextManager[MemoryPeerHarness]:
        return contextlib.nullcontext(MemoryPeerHarness())


TestInMemoryChunkIndexMachine = chunk_index_state_machine(
    lambda: memory_index_harness(capacity=1024)
).TestCase
TestInMemoryChunkStoreMachine = chunk_store_state_machine(memory_store_harness).TestCase


def test_a_missing_capability_skips_naming_it() -> None:
    with pytest.raises(pytest.skip.Exception, match="object does not declare SupportsStall"):
        require_stall(object())
