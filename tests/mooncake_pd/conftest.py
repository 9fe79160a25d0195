"""Fixtures for the P/D tests: peer transports, and simulated ranks holding KV in real layouts.

The protocol tests take ``peers``, and run twice: over real transfer engines (``mooncake``) and over the
in-memory reference transport (``memory``). The Mooncake runs need a loopback-only network namespace
(Mooncake listens on every interface); the in-memory runs need none.

Simulated ranks live in the test process, each with its own transport (with Mooncake its own real
``TransferEngine``: its own RPC port and TCP connections, bytes moving through loopback sockets) and its
own side channel: that exercises everything a rank process does, and one process hosts a whole (P, D)
pairing in milliseconds instead of the seconds a process per rank costs to start. The fault tests that
kill a side run it in a subprocess, with Mooncake only. Engines take a second each to start: the
session shares them (``EnginePool``), and each test gets fresh transports over them, closed after it.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

import attrs
import pytest
import torch
from attrs import frozen

from kvcore.config import PDConfig
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.ports import PeerTransport
from kvcore.testing.memory import InMemoryAddressSpace, InMemoryPeerTransport
from kvcore_mooncake.pd import MooncakePeerTransport, RankSpec
from kvcore_mooncake.pd.transport import TransferEngineLike, start_engine
from tests.netns import require_loopback_namespace

T = TypeVar("T")

BLOCK_TOKENS, HEAD_SIZE, LAYERS = 16, 32, 2
PRODUCER_BLOCKS, CONSUMER_BLOCKS = 12, 10
SENTINEL = -7  # consumer bytes no write may touch

FAST = PDConfig(handshake_timeout_s=0.5, handshake_retries=1, abort_timeout_s=3.0)
"""Short timeouts, so that fault tests end in seconds."""


class Peers(Protocol):
    """Where a P/D test gets its transports, and the memory its ranks' KV lives in."""

    def take(self, count: int) -> Sequence[PeerTransport]:
        """``count`` new transports, distinct peers; whatever the test leaves open is closed after it."""
        ...

    def memory(self, length: int) -> tuple[torch.Tensor, int]:
        """``length`` zeroed bytes that these transports can read and write: a ``uint8`` tensor over
        them, and the address of the first."""
        ...


class EnginePool:
    """Real transfer engines, started once per session: ``engines(n)`` gives ``n`` distinct ones."""

    def __init__(self) -> None:
        self._engines: list[TransferEngineLike] = []

    def engines(self, count: int) -> list[TransferEngineLike]:
        while len(self._engines) < count:
            self._engines.append(start_engine(PDConfig()))
        return self._engines[:count]


class MooncakePeers:
    """Fresh ``MooncakePeerTransport``s over the pool's engines; KV memory is torch's own."""

    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool
        self._taken: list[MooncakePeerTransport] = []

    def take(self, count: int) -> list[MooncakePeerTransport]:
        taken = [MooncakePeerTransport(engine, "127.0.0.1") for engine in self._pool.engines(count)]
        self._taken.extend(taken)
        return taken

    def memory(self, length: int) -> tuple[torch.Tensor, int]:
        tensor = torch.zeros(length, dtype=torch.uint8)
        return tensor, tensor.data_ptr()

    def close(self) -> None:
        for transport in self._taken:
            transport.close()


class MemoryPeers:
    """``InMemoryPeerTransport``s on one address space; KV memory is allocated in it and seen through a
    tensor that shares its bytes."""

    def __init__(self) -> None:
        self.space = InMemoryAddressSpace()
        self._names = itertools.count()
        self._taken: list[InMemoryPeerTransport] = []

    def take(self, count: int) -> list[InMemoryPeerTransport]:
        taken = [InMemoryPeerTransport(self.space, f"peer-{next(self._names)}") for _ in range(count)]
        self._taken.extend(taken)
        return taken

    def memory(self, length: int) -> tuple[torch.Tensor, int]:
        region = self.space.allocate(length)
        return torch.frombuffer(self.space.view(region), dtype=torch.uint8), region.address

    def close(self) -> None:
        for transport in self._taken:
            transport.close()


@pytest.fixture(scope="session")
def engine_pool() -> EnginePool:
    require_loopback_namespace()
    return EnginePool()


@pytest.fixture
def mooncake(engine_pool: EnginePool) -> Iterator[MooncakePeers]:
    """Transports over real engines (only inside a loopback-only namespace)."""
    require_loopback_namespace()
    with contextlib.closing(MooncakePeers(engine_pool)) as peers:
        yield peers


@pytest.fixture
def memory() -> Iterator[MemoryPeers]:
    """In-memory reference transports, with their test hooks (``fail_next``, ``stall``)."""
    with contextlib.closing(MemoryPeers()) as peers:
        yield peers


@pytest.fixture(params=["mooncake", "memory"])
def peers(request: pytest.FixtureRequest) -> Peers:
    """Each protocol test runs over both transports."""
    chosen: Peers = request.getfixturevalue(request.param)
    return chosen


def heads_of(rank: int, tp: int, total: int) -> range:
    """vLLM's rule, written out independently of ``kvcore``: an even split or one replicated head."""
    if total >= tp:
        return range(rank * total // tp, (rank + 1) * total // tp)
    return range(rank // (tp // total), rank // (tp // total) + 1)


def blocks_heads(tensor: torch.Tensor, kind: LayoutKind) -> torch.Tensor:
    """A view of one layer's tensor (physical HND shape) as ``[blocks, segments, heads, ...]``."""
    if kind in (LayoutKind.VLLM_CPU, LayoutKind.PAGED):  # [blocks, heads, tokens, 2*head]
        return tensor.unsqueeze(1)
    if kind is LayoutKind.FLASH_ATTN:  # [2, blocks, heads, tokens, head]
        return tensor.movedim(1, 0)
    return tensor  # FlashInfer [blocks, 2, heads, tokens, head]


@frozen(eq=False)
class SimRank:
    """One simulated rank: its KV (all layers in one storage, as vLLM allocates) and its spec."""

    spec: RankSpec
    storage: torch.Tensor  # [layers, *physical_shape] (a view), int16 standing in for a 2-byte dtype

    def layer(self, index: int) -> torch.Tensor:
        return blocks_heads(self.storage[index], self.spec.layout.kind)


def make_rank(
    peers: Peers,
    *,
    engine_id: str,
    kind: LayoutKind,
    total_heads: int,
    tp: int,
    rank: int,
    blocks: int,
    model: str = "tiny",
    order: HeadOrder = HeadOrder.HND,
    cross_layer: bool = False,
) -> SimRank:
    """A rank's KV in one buffer: layer after layer, or (``cross_layer``, vLLM's BL* orders) block after
    block, each block holding every layer's."""
    layout = KVLayout(kind, blocks, BLOCK_TOKENS, len(heads_of(rank, tp, total_heads)), HEAD_SIZE, 2, order)
    flat, address = peers.memory(LAYERS * layout.nbytes)
    if cross_layer:
        layout = attrs.evolve(layout, page_bytes=LAYERS * layout.block_bytes)
        shape = layout.physical_shape
        storage = flat.view(torch.int16).view(shape[0], LAYERS, *shape[1:]).transpose(0, 1)
        bases = [address + i * layout.block_bytes for i in range(LAYERS)]
    else:
        storage = flat.view(torch.int16).view(LAYERS, *layout.physical_shape)
        bases = [address + i * layout.nbytes for i in range(LAYERS)]
    storage.fill_(SENTINEL)
    spec = RankSpec(engine_id, model, "bfloat16", tp, rank, total_heads, layout, bases)
    return SimRank(spec, storage)


def global_kv(kind: LayoutKind, total_heads: int, request_blocks: int, seed: int) -> list[torch.Tensor]:
    """Per layer, the request's KV over every head, as ``[request blocks, segments, heads, ...]``."""
    layout = KVLayout(kind, request_blocks, BLOCK_TOKENS, total_heads, HEAD_SIZE, 2)
    generator = torch.Generator().manual_seed(seed)
    return [
        blocks_heads(
            torch.randint(-30000, 30000, layout.physical_shape, dtype=torch.int16, generator=generator), kind
        )
        for _ in range(LAYERS)
    ]


def fill_producer(sim: SimRank, kv: Sequence[torch.Tensor], src_blocks: Sequence[int]) -> None:
    """Producer rank: its heads of the request's KV at ``src_blocks``, other blocks random."""
    heads = heads_of(sim.spec.tp_rank, sim.spec.tp_size, sim.spec.total_kv_heads)
    sim.storage.random_(-30000, 30000)
    for layer, full in enumerate(kv):
        mine = sim.layer(layer)
        for request_block, block in enumerate(src_blocks):
            mine[block] = full[request_block, :, heads.start : heads.stop]


def expected_consumer(sim: SimRank, kv: Sequence[torch.Tensor], dst_blocks: Sequence[int]) -> torch.Tensor:
    """What a consumer rank must hold after the transfer: its heads at ``dst_blocks``, sentinel elsewhere."""
    heads = heads_of(sim.spec.tp_rank, sim.spec.tp_size, sim.spec.total_kv_heads)
    expected = torch.full_like(sim.storage, SENTINEL)
    for layer, full in enumerate(kv):
        view = blocks_heads(expected[layer], sim.spec.layout.kind)
        for request_block, block in enumerate(dst_blocks):
            view[block] = full[request_block, :, heads.start : heads.stop]
    return expected


def new_transfer_id() -> str:
    return f"xfer-{uuid.uuid4().hex[:12]}"


def wait_for(what: str, collect: Callable[[], Sequence[T]], count: int, timeout: float = 10.0) -> list[T]:
    """Call ``collect`` until it has returned ``count`` items in all; fail after ``timeout`` seconds."""
    got: list[T] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: {len(got)} of {count} after {timeout}s: {got}")
        got.extend(collect())
        time.sleep(0.002)
    return got
