"""TorchBlockMover on a CUDA engine: bit-exact round trips, and ordering against the engine's stream."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator

import attrs
import numpy as np
import pytest
import torch

from kvcore.execution.worker import BlockWorker
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.step import BlockOp, StepPlan
from kvcore.ports import BlockTransfer, Direction
from kvcore_cpu import EngineKV, HostMemory, TorchBlockMover
from kvcore_cpu.rows import routes
from kvcore_cpu.tier import MappedMover

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SETTLE = 30.0
BLOCKS = 32
HOST_BLOCKS = 40


class Rig:
    def __init__(
        self,
        layout: KVLayout,
        layers: int,
        *,
        shared: bool,
        host_blocks: int = HOST_BLOCKS,
        cross_layer: bool = False,
    ) -> None:
        shape = (layers, *layout.physical_shape)
        bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device="cuda")
        kv = bits.view(torch.bfloat16).unbind(0)
        self.tensors = list(kv) if shared else [t.clone() for t in kv]
        if cross_layer:  # vLLM's BL* orders: block after block, each holding every layer's
            blocks = bits.view(torch.bfloat16).transpose(0, 1).contiguous()
            self.tensors = list(blocks.transpose(0, 1).unbind(0))
            layout = attrs.evolve(layout, page_bytes=layers * layout.block_bytes)
        self.engine = EngineKV.register(self.tensors, layout)
        self.host = HostMemory.allocate(host_blocks, self.engine.host_block_bytes, self.engine.device)
        self.host.buffer.random_(0, 256)
        self.mover = TorchBlockMover(self.engine, self.host)

    def engine_block(self, block: int) -> bytes:
        torch.cuda.synchronize()
        return b"".join(p[block].cpu().numpy().tobytes() for p in self.engine.planes)

    def host_block(self, block: int) -> bytes:
        return self.host.blocks[block].numpy().tobytes()

    def run(self, direction: Direction, engine: list[int], host: list[int]) -> bool:
        job = self.mover.submit(BlockTransfer(direction, engine, host))
        (result,) = self.mover.wait([job], SETTLE)
        return result.ok

    def close(self) -> None:
        self.mover.close()
        self.host.close()


def layout(
    kind: LayoutKind, blocks: int = BLOCKS, tokens: int = 16, heads: int = 2, head: int = 64
) -> KVLayout:
    heads = 1 if kind in (LayoutKind.MLA, LayoutKind.STATE) else heads
    order = HeadOrder.NHD if kind is LayoutKind.FLASH_ATTN else HeadOrder.HND
    return KVLayout(kind, blocks, tokens, heads, head, dtype_size=2, head_order=order)


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig(layout(LayoutKind.FLASH_ATTN), 4, shared=False)
    yield made
    made.close()


def test_host_memory_is_page_locked(rig: Rig) -> None:
    assert rig.host.pinned
    assert rig.host.buffer.is_pinned()


@pytest.mark.parametrize("shared", [True, False], ids=["one-storage", "tensor-per-layer"])
@pytest.mark.parametrize("kind", list(LayoutKind), ids=[k.value for k in LayoutKind])
@pytest.mark.parametrize("pattern", ["contiguous", "random"])
def test_save_then_load_round_trip_is_bit_exact(kind: LayoutKind, shared: bool, pattern: str) -> None:
    # save 12 engine blocks -> host; zero the engine; load them back into other engine blocks
    rig = Rig(layout(kind), 3, shared=shared)
    rng = np.random.default_rng(1)
    if pattern == "contiguous":
        engine_ids, host_ids, targets = list(range(4, 16)), list(range(20, 32)), list(range(16, 28))
    else:
        engine_ids = rng.choice(BLOCKS, 12, replace=False).tolist()
        host_ids = rng.choice(HOST_BLOCKS, 12, replace=False).tolist()
        targets = rng.permutation(BLOCKS)[:12].tolist()
    before = [rig.engine_block(b) for b in range(BLOCKS)]
    assert rig.run(Direction.SAVE, engine_ids, host_ids)
    assert all(rig.host_block(h) == before[e] for e, h in zip(engine_ids, host_ids, strict=True))
    for plane in rig.engine.planes:
        plane[targets] = 0
    assert rig.run(Direction.LOAD, targets, host_ids)
    after = [rig.engine_block(b) for b in range(BLOCKS)]
    assert all(after[t] == before[e] for t, e in zip(targets, engine_ids, strict=True))
    assert all(after[b] == before[b] for b in range(BLOCKS) if b not in targets and b not in engine_ids)
    rig.close()


@pytest.mark.parametrize("pattern", ["contiguous", "random"])
@pytest.mark.parametrize("engine", ["one-plane", "cross-layer"])
def test_whole_block_engine_copies_runs_directly_or_staged(pattern: str, engine: str) -> None:
    # one MLA layer, or three layers interleaved block by block (a block of every layer is one run):
    # runs on both sides go straight between device and host, random ids through staging
    if engine == "one-plane":
        rig = Rig(layout(LayoutKind.MLA), 1, shared=True)
    else:
        rig = Rig(layout(LayoutKind.PAGED), 3, shared=True, cross_layer=True)
        (route,) = routes(rig.engine)
        assert route.whole_blocks
        assert route.engine_step == 3
    ids = (
        list(range(BLOCKS))
        if pattern == "contiguous"
        else np.random.default_rng(2).permutation(BLOCKS).tolist()
    )
    before = [rig.engine_block(b) for b in range(BLOCKS)]
    assert rig.run(Direction.SAVE, ids, list(range(BLOCKS)))
    assert [rig.host_block(h) for h in range(BLOCKS)] == [before[e] for e in ids]
    for tensor in rig.tensors:
        tensor.zero_()
    assert rig.run(Direction.LOAD, ids, list(range(BLOCKS)))
    assert [rig.engine_block(b) for b in range(BLOCKS)] == before
    rig.close()


def test_jobs_larger_than_one_staging_batch() -> None:
    # 200 blocks of 1 MiB, random ids: several staging batches of at most 64 MiB
    big = layout(LayoutKind.FLASH_INFER, blocks=256, tokens=256, heads=8, head=128)
    rig = Rig(big, 1, shared=True, host_blocks=256)
    rng = np.random.default_rng(3)
    engine_ids = rng.choice(256, 200, replace=False).tolist()
    host_ids = rng.choice(256, 200, replace=False).tolist()
    plane = rig.engine.planes[0]
    expected = plane[engine_ids].cpu()
    assert rig.run(Direction.SAVE, engine_ids, host_ids)
    assert torch.equal(rig.host.blocks[host_ids], expected)
    plane.zero_()
    assert rig.run(Direction.LOAD, engine_ids, host_ids)
    assert torch.equal(plane[engine_ids].cpu(), expected)
    rig.close()


@pytest.mark.parametrize("submitter", ["engine thread", "tier thread after a mark"])
def test_save_reads_blocks_after_the_compute_that_wrote_them(rig: Rig, submitter: str) -> None:
    # queue a long computation, then write block 3 on the same stream, then save at once: from the
    # engine's thread, or (as a tier does) from another thread, after a mark taken on the engine's
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        busy = busy @ busy / 64
    for plane in rig.engine.planes:
        plane[3].fill_(7)
    transfer = BlockTransfer(Direction.SAVE, [3], [0])
    if submitter == "engine thread":
        jobs = [rig.mover.submit(transfer)]
    else:
        mark, jobs = rig.mover.mark(), []
        thread = threading.Thread(target=lambda: jobs.append(rig.mover.submit_after(transfer, mark)))
        thread.start()
        thread.join(SETTLE)
    (result,) = rig.mover.wait(jobs, SETTLE)
    assert result.ok
    assert rig.host_block(0) == bytes([7]) * rig.engine.host_block_bytes


def test_host_memory_over_a_shared_mapping_is_page_locked_and_round_trips() -> None:
    # as over an LMCache server's shared-memory pool
    made = Rig(layout(LayoutKind.FLASH_ATTN), 2, shared=False)
    pool = mmap.mmap(-1, 8 * made.engine.host_block_bytes + 100)
    mover = MappedMover(made.engine, pool)
    try:
        assert mover.host.pinned
        assert mover.host.num_blocks == 8
        saved = mover.submit(BlockTransfer(Direction.SAVE, [6, 7], [2, 5]))
        assert all(r.ok for r in mover.wait([saved], SETTLE))
        assert mover.host.blocks[5].numpy().tobytes() == made.engine_block(7)
        loaded = mover.submit(BlockTransfer(Direction.LOAD, [6], [5]))
        assert all(r.ok for r in mover.wait([loaded], SETTLE))
        assert made.engine_block(6) == made.engine_block(7)
    finally:
        mover.close()
        made.close()


def test_wait_loaded_orders_the_engine_after_the_load(rig: Rig) -> None:
    # load host 5 -> engine 9, make the current stream wait, read block 9 on it without a host sync
    rig.host.blocks[5].fill_(42)
    job = rig.mover.submit(BlockTransfer(Direction.LOAD, [9], [5]))
    rig.mover.wait_loaded(job, SETTLE)
    seen = torch.cat([p[9] for p in rig.engine.planes]).to("cpu", non_blocking=False)
    assert bool((seen == 42).all())
    (result,) = rig.mover.wait([job], SETTLE)
    assert result.ok


def test_a_worker_orders_the_forward_pass_after_its_loads_on_the_device(rig: Rig) -> None:
    # the vLLM worker's synchronous load on CUDA: BlockWorker.order_loads makes the engine's stream wait
    # on the copy (no host wait); work queued after it reads the loaded bytes; the report comes after
    worker = BlockWorker(rig.mover)
    assert worker.orders_loads_on_device
    rig.host.blocks[6].fill_(17)
    worker.execute(StepPlan((BlockOp(1, Direction.LOAD, (11,), (6,), "r"),)))
    assert worker.order_loads([1]) == {1}
    seen = torch.cat([p[11] for p in rig.engine.planes]).to("cpu", non_blocking=False)
    assert bool((seen == 17).all())
    (report,) = [r for r in worker.wait([1], SETTLE) if r.op_id == 1]
    assert report.failed == ()


def test_loads_and_saves_run_at_once_on_their_own_streams(rig: Rig) -> None:
    # save engine [0..8) -> host [0..8) while loading host [20..28) -> engine [16..24)
    before = [rig.engine_block(b) for b in range(8)]
    incoming = [rig.host_block(h) for h in range(20, 28)]
    save = rig.mover.submit(BlockTransfer(Direction.SAVE, list(range(8)), list(range(8))))
    load = rig.mover.submit(BlockTransfer(Direction.LOAD, list(range(16, 24)), list(range(20, 28))))
    assert all(r.ok for r in rig.mover.wait([save, load], SETTLE))
    assert [rig.host_block(h) for h in range(8)] == before
    assert [rig.engine_block(b) for b in range(16, 24)] == incoming
