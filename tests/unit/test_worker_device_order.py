"""Loads ordered on the engine's device (``BlockWorker.order_loads``): a load whose copy is queued on a
mover that orders on the device (``SupportsDeviceOrder``, a CUDA engine) is handed to it with no host
wait; a load still fetching from the remote tier, a save, and every load of a mover that cannot order
on the device are not. The device behaviour itself (the engine's stream waits on the copy's event) is
covered against a real CUDA mover in ``tests/gpu/test_cuda_mover.py``."""

from __future__ import annotations

import torch

from kvcore.execution.remote import StoreRemote
from kvcore.execution.worker import BlockWorker
from kvcore.ids import ChunkKey, JobId
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.step import BlockOp, RemoteChunk, StepPlan
from kvcore.ports import Direction, SupportsDeviceOrder
from kvcore.testing.memory import InMemoryBlockMover, InMemoryChunkStore
from kvcore_cpu import EngineKV, HostMemory, TorchBlockMover

BLOCK = 32


class DeviceOrderedMover(InMemoryBlockMover):
    """The in-memory mover standing for a CUDA engine's: it records the loads the engine's work was
    ordered after (a stream wait, which never blocks the host)."""

    orders_on_device = True

    def __init__(self, block_bytes: int = BLOCK) -> None:
        super().__init__(num_engine_blocks=16, num_host_blocks=16, layer_block_bytes=block_bytes)
        self.ordered: list[JobId] = []

    def wait_loaded(self, job_id: JobId, timeout: float) -> None:
        self.ordered.append(job_id)


def _op(op_id: int, direction: Direction) -> BlockOp:
    return BlockOp(op_id, direction, (op_id,), (op_id,), f"r{op_id}")


def test_a_queued_load_is_ordered_on_the_device_and_still_reported() -> None:
    mover = DeviceOrderedMover()
    assert isinstance(mover, SupportsDeviceOrder)
    worker = BlockWorker(mover)
    assert worker.orders_loads_on_device
    mover.write_host_block(1, b"\x01" * BLOCK)
    with mover.stall():
        worker.execute(StepPlan((_op(1, Direction.LOAD), _op(2, Direction.SAVE))))
        assert worker.order_loads([1, 2, 9]) == {1}  # the save, and an op never executed, are not
        assert len(mover.ordered) == 1
    (report,) = [r for r in worker.wait([1], 5.0) if r.op_id == 1]
    assert report.failed == ()
    assert mover.read_engine_block(1) == b"\x01" * BLOCK
    worker.close()


def test_a_load_still_fetching_from_the_remote_tier_is_awaited_on_the_host() -> None:
    mover = DeviceOrderedMover()
    store = InMemoryChunkStore(mover.host)
    worker = BlockWorker(mover, remote=StoreRemote(store), slot_bytes=BLOCK, slot_blocks=1)
    chunk = RemoteChunk(slot=3, keys=(ChunkKey("k"),), first=0, count=1)
    op = BlockOp(3, Direction.LOAD, (3,), (3,), "r3", (chunk,), 0, ((ChunkKey("k"),),))
    with store.stall():
        worker.execute(StepPlan((op,)))
        assert worker.order_loads([3]) == set()
    assert mover.ordered == []
    worker.wait([3], 5.0)
    worker.close()


def test_a_mover_that_cannot_order_on_the_device_orders_nothing() -> None:
    plain = InMemoryBlockMover(num_engine_blocks=8, num_host_blocks=8, layer_block_bytes=BLOCK)
    worker = BlockWorker(plain)
    with plain.stall():
        worker.execute(StepPlan((_op(1, Direction.LOAD),)))
        assert not worker.orders_loads_on_device
        assert worker.order_loads([1]) == set()
    worker.close()
    # kvcore's own mover orders on the device on CUDA engines only: a CPU engine's host waits
    layout = KVLayout(LayoutKind.MLA, 4, 4, 1, 8, 2)
    kv = EngineKV.register([torch.zeros(layout.shape, dtype=torch.bfloat16)], layout)
    with HostMemory.allocate(2, kv.host_block_bytes, kv.device) as host:
        mover = TorchBlockMover(kv, host)
        assert isinstance(mover, SupportsDeviceOrder)
        assert not mover.orders_on_device
        mover.close()
