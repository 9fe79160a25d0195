"""The conformance suite run against the CPU backend: the block pool as an index, the torch block mover.

The index harness changes what the pool holds out of band, through the pool's own two-phase store and
``remove``, and declares the pool's slot count and pins. The mover harnesses copy between real torch
tensors in three layouts; they read and write blocks out of band through the declared ``KVLayout``'s
byte ranges, never through ``EngineKV``'s views, so that a view mapping the wrong bytes shows. Failures
and stalls are injected through the mover's fault hooks (``kvcore.testing.faults.InjectedFaults``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import torch
from attrs import frozen

from kvcore.ids import ChunkKey
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.pool.block_pool import BlockPool
from kvcore.pool.pool_index import PoolIndex
from kvcore.testing.faults import InjectedFaults
from kvcore.testing.index import ChunkIndexTests, chunk_index_state_machine
from kvcore.testing.mover import BlockMoverTests
from kvcore.testing.ordered import OrderedMoverTests
from kvcore.testing.support import SETTLE_S
from kvcore_cpu import EngineKV, HostMemory, TorchBlockMover

POOL_SLOTS = 8
ENGINE_BLOCKS = 12
HOST_BLOCKS = 16
LAYERS = 3

ByteArray = npt.NDArray[np.uint8]


# -- the block pool as a chunk index -------------------------------------------------------------------


class PoolIndexHarness:
    """A ``PoolIndex`` over a pool of ``num_slots``; presence is changed through the pool directly."""

    def __init__(self, num_slots: int) -> None:
        self.pool = BlockPool(num_slots)
        self.backend = PoolIndex(self.pool)
        self.capacity = num_slots

    def make_present(self, keys: Sequence[ChunkKey]) -> None:
        self.pool.prepare_store(keys)
        self.pool.complete_store(keys, success=True)

    def make_absent(self, keys: Sequence[ChunkKey]) -> None:
        self.pool.remove(keys)

    def pin(self, keys: Sequence[ChunkKey]) -> None:
        self.pool.pin(keys)

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        self.pool.unpin(keys)


@contextlib.contextmanager
def pool_index_harness(num_slots: int = POOL_SLOTS) -> Iterator[PoolIndexHarness]:
    yield PoolIndexHarness(num_slots)


class TestPoolIndex(ChunkIndexTests[PoolIndex]):
    def make_harness(self) -> contextlib.AbstractContextManager[PoolIndexHarness]:
        return pool_index_harness()


TestPoolIndexMachine = chunk_index_state_machine(lambda: pool_index_harness(num_slots=64)).TestCase


# -- the torch block mover -----------------------------------------------------------------------------


@frozen
class MoverCase:
    """One way an engine hands its KV over: the layout, and whether all layers share one storage."""

    kind: LayoutKind
    head_order: HeadOrder
    one_storage: bool

    def layout(self) -> KVLayout:
        heads = 1 if self.kind in (LayoutKind.MLA, LayoutKind.STATE) else 2
        return KVLayout(self.kind, ENGINE_BLOCKS, 4, heads, 8, dtype_size=2, head_order=self.head_order)


class TorchMoverHarness:
    """A mover over bf16 engine tensors and host memory, with out-of-band block access.

    ``memory`` keeps every layer's bytes in memory order; an engine block is, layer after layer, the
    bytes of the layout's segments of that block (K then V), which is what a host block holds.
    """

    def __init__(self, case: MoverCase) -> None:
        self.layout = case.layout()
        physical = torch.zeros((LAYERS, *self.layout.physical_shape), dtype=torch.bfloat16)
        layers = list(physical.unbind(0)) if case.one_storage else [t.clone() for t in physical.unbind(0)]
        self.memory: list[ByteArray] = [t.reshape(-1).view(torch.uint8).numpy() for t in layers]
        # The engine's own view: HND FlashAttention keeps the NHD axis order and permutes the strides.
        permuted = self.layout.shape != self.layout.physical_shape
        engine = EngineKV.register([t.transpose(2, 3) if permuted else t for t in layers], self.layout)
        self.host = HostMemory.allocate(HOST_BLOCKS, engine.host_block_bytes, engine.device)
        self.host_bytes: ByteArray = self.host.buffer.numpy()
        # a stall is bounded, so that a test that forgets to leave it fails instead of hanging the worker
        faults = InjectedFaults(stall_limit_s=SETTLE_S)
        self.backend = TorchBlockMover(engine, self.host, faults=faults)
        self.num_engine_blocks = ENGINE_BLOCKS
        self.num_host_blocks = HOST_BLOCKS
        self.block_bytes = LAYERS * self.layout.block_bytes
        self.fail_next = faults.fail_next
        self.stall = faults.stall

    def read_engine_block(self, block: int) -> bytes:
        segments = self.layout.segments(block)
        return b"".join(layer[s.offset : s.stop].tobytes() for layer in self.memory for s in segments)

    def write_engine_block(self, block: int, data: bytes) -> None:
        source = np.frombuffer(data, dtype=np.uint8)
        at = 0
        for layer in self.memory:
            for segment in self.layout.segments(block):
                layer[segment.offset : segment.stop] = source[at : at + segment.length]
                at += segment.length

    def read_host_block(self, block: int) -> bytes:
        return self.host_bytes[block * self.block_bytes : (block + 1) * self.block_bytes].tobytes()

    def write_host_block(self, block: int, data: bytes) -> None:
        self.host_bytes[block * self.block_bytes : (block + 1) * self.block_bytes] = np.frombuffer(
            data, dtype=np.uint8
        )

    def close(self) -> None:
        self.backend.close()
        self.host.close()


@contextlib.contextmanager
def torch_mover_harness(case: MoverCase) -> Iterator[TorchMoverHarness]:
    harness = TorchMoverHarness(case)
    try:
        yield harness
    finally:
        harness.close()


class _TorchBlockMoverSuite(BlockMoverTests[TorchBlockMover], OrderedMoverTests[TorchBlockMover]):
    case: ClassVar[MoverCase]

    def make_harness(self) -> contextlib.AbstractContextManager[TorchMoverHarness]:
        return torch_mover_harness(self.case)


class TestTorchBlockMoverVllmCpu(_TorchBlockMoverSuite):
    """vLLM's CPU backend: every layer a view into one allocation (the mover copies shared rows)."""

    case = MoverCase(LayoutKind.VLLM_CPU, HeadOrder.HND, one_storage=True)


class TestTorchBlockMoverFlashAttention(_TorchBlockMoverSuite):
    """FlashAttention, NHD, one tensor per layer (the mover copies one plane at a time)."""

    case = MoverCase(LayoutKind.FLASH_ATTN, HeadOrder.NHD, one_storage=False)


class TestTorchBlockMoverFlashAttentionHnd(_TorchBlockMoverSuite):
    """FlashAttention, HND, handed over as the engine's permuted view, all layers in one allocation."""

    case = MoverCase(LayoutKind.FLASH_ATTN, HeadOrder.HND, one_storage=True)
