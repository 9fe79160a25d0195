"""TorchBlockMover on CPU tensors: bit-exact copies for every layout, validation, threads, failures, close."""

from __future__ import annotations

import math
import mmap
import re
import threading
from collections.abc import Iterator

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import ConfigError, InvalidSpecError, TransferTimeout, UsageError
from kvcore.ids import JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.kit.faults import FaultHooks
from kvcore.model.engine import EngineSpec
from kvcore.model.head_runs import HeadRuns
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.plugins.sizing import pool_slots
from kvcore.ports import BlockTransfer, Direction, SupportsReopen
from kvcore.testing.faults import TransferGate
from kvcore_cpu import EngineKV, HostMemory, TorchBlockMover
from kvcore_cpu._rowcopy import copy_rows
from kvcore_cpu.cpu_copy import BlockCopier, ByteRows
from kvcore_cpu.cpu_lane import CpuLane
from kvcore_cpu.rows import IntArray, routes
from kvcore_cpu.tier import MappedMover

SETTLE = 10.0
ENGINE_BLOCKS = 24
HOST_BLOCKS = 32
LAYERS = 3


def make_layout(kind: LayoutKind, blocks: int = ENGINE_BLOCKS, tokens: int = 4) -> KVLayout:
    heads = 1 if kind in (LayoutKind.MLA, LayoutKind.STATE) else 2
    order = HeadOrder.NHD if kind in (LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER) else HeadOrder.HND
    return KVLayout(kind, blocks, tokens, heads, head_size=16, dtype_size=2, head_order=order)


def random_kv(layout: KVLayout, *, shared: bool, seed: int = 0) -> list[torch.Tensor]:
    """Random bf16 KV: one storage for all layers (vLLM CPU style) or one tensor per layer."""
    generator = torch.Generator().manual_seed(seed)
    shape = (LAYERS, *layout.physical_shape)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
    kv = bits.view(torch.bfloat16)
    return list(kv.unbind(0)) if shared else [t.clone() for t in kv.unbind(0)]


class Rig:
    """A mover over random engine KV and host memory, with out-of-band reads of both."""

    def __init__(self, mover: TorchBlockMover, engine: EngineKV, host: HostMemory) -> None:
        self.mover = mover
        self.engine = engine
        self.host = host

    def engine_block(self, block: int) -> bytes:
        return b"".join(plane[block].numpy().tobytes() for plane in self.engine.planes)

    def host_block(self, block: int) -> bytes:
        return self.host.blocks[block].numpy().tobytes()

    def engine_blocks(self) -> list[bytes]:
        return [self.engine_block(b) for b in range(self.engine.num_blocks)]

    def host_blocks(self) -> list[bytes]:
        return [self.host_block(b) for b in range(self.host.num_blocks)]

    def run(self, direction: Direction, engine: list[int], host: list[int]) -> JobResult:
        job = self.mover.submit(BlockTransfer(direction, engine, host))
        (result,) = self.mover.wait([job], SETTLE)
        return result


def make_rig(
    kind: LayoutKind = LayoutKind.VLLM_CPU,
    *,
    shared: bool = True,
    blocks: int = ENGINE_BLOCKS,
    host_blocks: int = HOST_BLOCKS,
    tokens: int = 4,
    faults: FaultHooks | None = None,
) -> Rig:
    layout = make_layout(kind, blocks, tokens)
    engine = EngineKV.register(random_kv(layout, shared=shared), layout)
    host = HostMemory.allocate(host_blocks, engine.host_block_bytes, engine.device)
    host.buffer.copy_(torch.randint(0, 256, (host.nbytes,), dtype=torch.uint8))
    return Rig(TorchBlockMover(engine, host, faults=faults), engine, host)


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = make_rig()
    yield made
    made.mover.close()


class FirstPairFails(FaultHooks):
    """The first pair of every copy fails (a partial tier failure); the others are copied."""

    def before_transfer(self, direction: Direction, items: int) -> int:
        return 1


class Broken(FaultHooks):
    def before_transfer(self, direction: Direction, items: int) -> int:
        raise OSError("memory controller on fire")


def gated_rig() -> tuple[Rig, TransferGate]:
    """A rig whose copies wait at a closed gate."""
    gate = TransferGate(SETTLE)
    return make_rig(faults=gate), gate


# -- bit-exact copies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shared", [True, False], ids=["one-storage", "tensor-per-layer"])
@pytest.mark.parametrize("kind", list(LayoutKind), ids=[k.value for k in LayoutKind])
def test_save_then_load_round_trip_is_bit_exact(kind: LayoutKind, shared: bool) -> None:
    # save engine [random 10] -> host [random 10]; scribble; load host -> other engine blocks
    rig = make_rig(kind, shared=shared)
    rng = np.random.default_rng(7)
    engine_ids = rng.choice(ENGINE_BLOCKS, 10, replace=False).tolist()
    host_ids = rng.choice(HOST_BLOCKS, 10, replace=False).tolist()
    before = rig.engine_blocks()
    host_before = rig.host_blocks()

    assert rig.run(Direction.SAVE, engine_ids, host_ids).ok
    host_after = rig.host_blocks()
    for e, h in zip(engine_ids, host_ids, strict=True):
        assert host_after[h] == before[e]
    assert [host_after[h] for h in range(HOST_BLOCKS) if h not in host_ids] == [
        host_before[h] for h in range(HOST_BLOCKS) if h not in host_ids
    ]
    assert rig.engine_blocks() == before

    targets = rng.permutation(ENGINE_BLOCKS)[:10].tolist()
    for plane in rig.engine.planes:
        plane[targets].zero_()
    assert rig.run(Direction.LOAD, targets, host_ids).ok
    after = rig.engine_blocks()
    for t, e in zip(targets, engine_ids, strict=True):
        assert after[t] == before[e]
    assert [after[b] for b in range(ENGINE_BLOCKS) if b not in targets] == [
        before[b] for b in range(ENGINE_BLOCKS) if b not in targets
    ]
    rig.mover.close()


@pytest.mark.parametrize(
    ("engine_ids", "host_ids"),
    [
        (list(range(4, 20)), list(range(8, 24))),  # one run on both sides: one slice copy
        ([9, 10, 11, 2, 3, 4, 20], [0, 1, 2, 3, 4, 5, 6]),  # host run, engine runs
        ([5, 1, 17, 12, 3, 8], [20, 21, 22, 23, 24, 25]),  # host run, engine random
        ([6, 7, 8, 9, 10, 11], [30, 2, 17, 9, 4, 25]),  # engine run, host random
        ([13, 2, 21, 7, 0, 16], [3, 29, 11, 18, 0, 24]),  # random both
        ([3, 3, 3], [1, 5, 9]),  # one source saved to three host blocks
    ],
    ids=["runs", "host-run-engine-runs", "host-run", "engine-run", "random", "repeated-source"],
)
@pytest.mark.parametrize("shared", [True, False], ids=["one-storage", "tensor-per-layer"])
def test_id_patterns_copy_the_right_blocks(shared: bool, engine_ids: list[int], host_ids: list[int]) -> None:
    rig = make_rig(LayoutKind.FLASH_ATTN, shared=shared)
    engine = rig.engine_blocks()
    assert rig.run(Direction.SAVE, engine_ids, host_ids).ok
    host = rig.host_blocks()
    assert all(host[h] == engine[e] for e, h in zip(engine_ids, host_ids, strict=True))
    if len(set(engine_ids)) == len(engine_ids):
        for plane in rig.engine.planes:
            plane.zero_()
        assert rig.run(Direction.LOAD, engine_ids, host_ids).ok
        after = rig.engine_blocks()
        assert all(after[e] == engine[e] for e in engine_ids)
        assert not any(any(after[b]) for b in range(ENGINE_BLOCKS) if b not in engine_ids)
    rig.mover.close()


@pytest.mark.parametrize("pattern", ["contiguous", "random"])
def test_large_jobs_split_across_threads_stay_exact(pattern: str) -> None:
    # 96 blocks x 3 layers x 32 KiB rows = 9 MiB: split between the worker and its helper
    rig = make_rig(LayoutKind.VLLM_CPU, blocks=128, host_blocks=128, tokens=512)
    rng = np.random.default_rng(3)
    if pattern == "contiguous":
        engine_ids, host_ids = list(range(16, 112)), list(range(96))
    else:
        engine_ids = rng.choice(128, 96, replace=False).tolist()
        host_ids = rng.choice(128, 96, replace=False).tolist()
    engine = rig.engine_blocks()
    assert rig.run(Direction.SAVE, engine_ids, host_ids).ok
    host = rig.host_blocks()
    assert all(host[h] == engine[e] for e, h in zip(engine_ids, host_ids, strict=True))
    for plane in rig.engine.planes:
        plane.zero_()
    assert rig.run(Direction.LOAD, engine_ids, host_ids).ok
    after = rig.engine_blocks()
    assert all(after[e] == engine[e] for e in engine_ids)
    rig.mover.close()


@st.composite
def row_copies(draw: st.DrawFn) -> tuple[ByteRows, ByteRows, IntArray, IntArray]:
    """Random source and destination rows (either sometimes strided, the source sometimes reversed),
    pairs with distinct destinations, sorted half of the time so that runs appear on both sides."""
    rows = draw(st.integers(1, 40))
    width = draw(st.sampled_from([1, 7, 24, 100, 4096]))
    count = draw(st.integers(0, rows))
    s = np.asarray(draw(st.lists(st.integers(0, rows - 1), min_size=count, max_size=count)), np.int64)
    d = np.asarray(draw(st.permutations(range(rows))), np.int64)[:count]
    if draw(st.booleans()):
        s, d = np.sort(s), np.sort(d)
    rng = np.random.default_rng(count)
    layout = draw(st.sampled_from(["contiguous", "strided", "reversed"]))
    src = rng.integers(0, 256, (rows, 2 * width if layout == "strided" else width), dtype=np.uint8)
    src = src[:, width:] if layout == "strided" else src[::-1] if layout == "reversed" else src
    offset = draw(st.integers(0, 15))  # destination rows at any alignment
    dst = rng.integers(0, 256, rows * 2 * width + offset, dtype=np.uint8)[offset:].reshape(rows, 2 * width)
    return src, (dst[:, width:] if draw(st.booleans()) else dst[:, :width]), s, d


@settings(max_examples=120, deadline=None)
@given(copies=row_copies(), stream=st.booleans())
def test_copy_rows_matches_numpy_fancy_indexing(
    copies: tuple[ByteRows, ByteRows, IntArray, IntArray], stream: bool
) -> None:
    # any pairs with distinct destinations, any row strides and alignments, cached or streaming stores
    # -> dst[d] = src[s], and nothing else in dst changes
    src, dst, s, d = copies
    expected = dst.copy()
    expected[d] = src[s]
    copy_rows(src, dst, s, d, stream=stream)
    assert np.array_equal(dst, expected)


def test_copy_rows_refuses_bad_buffers_before_copying() -> None:
    # every bad argument -> an error naming it and the value; dst untouched
    src = np.arange(12, dtype=np.uint8).reshape(3, 4)
    dst = np.zeros((3, 4), dtype=np.uint8)
    rows = np.array([0, 1], dtype=np.int64)
    cases: list[tuple[tuple[object, ...], type[Exception], str]] = [
        ((src, dst, np.array([0, 3]), rows), IndexError, r"src_rows\[1\]: row 3 is outside \[0, 3\)"),
        ((src, dst, rows, np.array([-1, 0])), IndexError, r"dst_rows\[0\]: row -1 is outside \[0, 3\)"),
        ((src, dst, rows, rows[:1]), ValueError, r"dst_rows: got 1 rows, expected 2"),
        ((src, dst[:, :3], rows, rows), ValueError, r"dst: got rows of 3 bytes, expected 4"),
        ((src, dst[:, ::2], rows, rows), ValueError, r"dst: got a byte stride of 2 within a row"),
        ((src.view(np.int16), dst, rows, rows), ValueError, r"src: got a 2-D buffer of format 'h'"),
        ((src.ravel(), dst, rows, rows), ValueError, r"src: got a 1-D buffer"),
        ((src, dst, rows.astype(np.int32), rows), ValueError, r"src_rows: got a 1-D buffer of format 'i'"),
        ((src, dst, np.array([0, 0, 1, 1])[::2], rows), TypeError, r"src_rows: got numpy.ndarray, expected"),
        ((src, dst, [0, 1], rows), TypeError, r"src_rows: got list"),
        ((src, b"\0" * 12, rows, rows), TypeError, r"dst: got bytes, expected a writable 2-D buffer"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            copy_rows(*args)  # type: ignore[arg-type]  # wrong types on purpose
    assert not dst.any()


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("blocks", [8, 600])
def test_copier_pieces_cover_every_pair_once(threads: int, blocks: int, shared: bool) -> None:
    # a job large enough to be split into pieces over helper threads and streamed, or small enough to
    # stay whole on the caller's thread; one route over every plane or one per plane -> every block pair
    # copied, both directions, nothing else touched
    layout = make_layout(LayoutKind.VLLM_CPU, blocks=2 * blocks, tokens=64)
    engine = EngineKV.register(random_kv(layout, shared=shared, seed=blocks), layout)
    rng = np.random.default_rng(blocks)
    with HostMemory.allocate(2 * blocks, engine.host_block_bytes, torch.device("cpu")) as host:
        host.buffer.fill_(7)
        copier = BlockCopier([routes(engine)], host, threads)
        engine_ids = rng.choice(2 * blocks, blocks, replace=False).astype(np.int64)
        host_ids = rng.choice(2 * blocks, blocks, replace=False).astype(np.int64)
        copier.copy(Direction.SAVE, engine_ids, host_ids)
        planes = [tensor.numpy() for tensor in engine.planes]
        saved = host.blocks.numpy().reshape(2 * blocks, len(planes), -1)
        for q, plane in enumerate(planes):
            assert np.array_equal(saved[host_ids, q], plane[engine_ids])
        untouched = np.setdiff1d(np.arange(2 * blocks), host_ids)
        assert (saved[untouched] == 7).all()
        before = [plane.copy() for plane in planes]
        for tensor in engine.planes:
            tensor.zero_()
        copier.copy(Direction.LOAD, engine_ids, host_ids)
        for q, plane in enumerate(planes):
            assert np.array_equal(plane[engine_ids], before[q][engine_ids])
            assert not plane[np.setdiff1d(np.arange(2 * blocks), engine_ids)].any()
        copier.close()


def test_empty_transfer_finishes_at_once(rig: Rig) -> None:
    assert rig.run(Direction.SAVE, [], []).ok


# -- validation: nothing copied ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("direction", "engine_ids", "host_ids", "message"),
    [
        (Direction.SAVE, [0, ENGINE_BLOCKS], [0, 1], rf"engine_blocks: block {ENGINE_BLOCKS} is outside"),
        (Direction.LOAD, [-1, 2], [0, 1], r"engine_blocks: block -1 is outside"),
        (Direction.SAVE, [0, 1], [HOST_BLOCKS, 1], rf"host_blocks: block {HOST_BLOCKS} is outside"),
        (Direction.LOAD, [0, 1], [0, -3], r"host_blocks: block -3 is outside"),
        (Direction.SAVE, [0, 1, 2], [4, 5, 4], r"host_blocks: block 4 is a destination twice"),
        (Direction.LOAD, [7, 3, 7], [0, 1, 2], r"engine_blocks: block 7 is a destination twice"),
    ],
)
def test_bad_ids_raise_before_anything_is_copied(
    rig: Rig, direction: Direction, engine_ids: list[int], host_ids: list[int], message: str
) -> None:
    engine, host = rig.engine_blocks(), rig.host_blocks()
    with pytest.raises(InvalidSpecError, match=message):
        rig.mover.submit(BlockTransfer(direction, engine_ids, host_ids))
    assert rig.mover.poll() == ()
    assert rig.engine_blocks() == engine
    assert rig.host_blocks() == host


def test_mismatched_lengths_raise(rig: Rig) -> None:
    host = rig.host_blocks()
    with pytest.raises(InvalidSpecError, match="host_blocks has 1 entries"):
        rig.mover.submit(BlockTransfer(Direction.SAVE, (0, 1), (0,)))
    assert rig.host_blocks() == host


def test_host_memory_must_hold_one_block_of_every_layer() -> None:
    layout = make_layout(LayoutKind.MLA)
    engine = EngineKV.register(random_kv(layout, shared=True), layout)
    host = HostMemory.allocate(4, engine.host_block_bytes // LAYERS, engine.device)
    with pytest.raises(InvalidSpecError, match=rf"block_bytes: got {engine.host_block_bytes // LAYERS}"):
        TorchBlockMover(engine, host)
    with pytest.raises(ConfigError, match="copy_threads"):
        TorchBlockMover(
            engine, HostMemory.allocate(4, engine.host_block_bytes, engine.device), copy_threads=0
        )


def test_a_mapped_mover_copies_into_memory_it_does_not_own_and_leaves_it_mapped() -> None:
    layout = make_layout(LayoutKind.FLASH_ATTN)
    engine = EngineKV.register(random_kv(layout, shared=False), layout)
    pool = mmap.mmap(-1, 3 * engine.host_block_bytes + 7)  # as a server's pool: not a whole number of blocks
    mover = MappedMover(engine, pool)
    assert mover.host.num_blocks == 3
    job = mover.submit_after(BlockTransfer(Direction.SAVE, [5], [2]), mover.mark())
    (result,) = mover.wait([job], 5.0)
    assert result.ok
    at = 2 * engine.host_block_bytes
    expected = b"".join(plane[5].numpy().tobytes() for plane in engine.planes)
    assert pool[at : at + engine.host_block_bytes] == expected
    mover.close()
    with pytest.raises(ConfigError, match="at least one block"):
        MappedMover(engine, mmap.mmap(-1, engine.host_block_bytes - 1))


# -- threads, waits, failures, close -------------------------------------------------------------------


def test_concurrent_submitters_stay_correct(rig: Rig) -> None:
    # 4 threads x 6 single-block saves into disjoint host blocks, then loads back into disjoint blocks
    engine = rig.engine_blocks()
    errors: list[BaseException] = []

    def worker(thread: int) -> None:
        try:
            jobs = [
                rig.mover.submit(BlockTransfer(Direction.SAVE, [thread * 6 + i], [thread * 8 + i]))
                for i in range(6)
            ]
            results = rig.mover.wait(jobs, SETTLE)
            assert [r.job_id for r in results] == jobs
            assert all(r.ok for r in results)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SETTLE)
    assert not errors
    host = rig.host_blocks()
    assert all(host[t * 8 + i] == engine[t * 6 + i] for t in range(4) for i in range(6))


def test_wait_times_out_and_the_result_arrives_later() -> None:
    rig, gate = gated_rig()
    mover = rig.mover
    job = mover.submit(BlockTransfer(Direction.SAVE, [1, 2], [3, 4]))
    with pytest.raises(TransferTimeout):
        mover.wait([job], 0)
    with pytest.raises(TransferTimeout):
        mover.wait([job], 0.02)
    gate.opened.set()
    (result,) = mover.wait([job], SETTLE)
    assert result.ok
    assert rig.host_block(3) == rig.engine_block(1)
    mover.close()


def test_wait_loaded_blocks_until_the_load_is_in_place() -> None:
    rig, gate = gated_rig()
    mover = rig.mover
    job = mover.submit(BlockTransfer(Direction.LOAD, [5], [9]))
    with pytest.raises(TransferTimeout, match=f"load job {job}"):
        mover.wait_loaded(job, 0.02)
    gate.opened.set()
    mover.wait_loaded(job, SETTLE)
    assert rig.engine_block(5) == rig.host_block(9)
    (result,) = mover.wait([job], SETTLE)  # the result is still handed out once
    assert result.ok
    mover.close()


def test_queued_loads_go_before_queued_saves() -> None:
    # first save holds the worker; then save, load queued -> the load runs next
    rig, gate = gated_rig()
    mover = rig.mover
    jobs = [mover.submit(BlockTransfer(Direction.SAVE, [0], [0]))]
    assert gate.entered.wait(SETTLE)
    jobs.append(mover.submit(BlockTransfer(Direction.SAVE, [1], [1])))
    jobs.append(mover.submit(BlockTransfer(Direction.LOAD, [2], [2])))
    gate.opened.set()
    assert all(r.ok for r in mover.wait(jobs, SETTLE))
    assert gate.order == [Direction.SAVE, Direction.LOAD, Direction.SAVE]
    mover.close()


def test_a_copy_that_raises_is_a_failed_result() -> None:
    rig = make_rig(faults=Broken())
    result = rig.run(Direction.SAVE, [0, 1, 2], [0, 1, 2])
    assert result.failed == (0, 1, 2)
    assert result.error == "OSError: memory controller on fire"
    assert rig.mover.poll() == ()
    rig.mover.close()


def test_a_partial_failure_reports_the_failed_pairs() -> None:
    # save engine [0, 1, 2] -> host [4, 5, 6], pair 0 fails: 5 and 6 copied
    rig = make_rig(faults=FirstPairFails())
    result = rig.run(Direction.SAVE, [0, 1, 2], [4, 5, 6])
    assert result.failed == (0,)
    assert not result.ok
    assert rig.host_block(5) == rig.engine_block(1)
    assert rig.host_block(6) == rig.engine_block(2)
    rig.mover.close()


def test_close_with_jobs_in_flight_reports_every_job() -> None:
    # job 1 held at the worker, jobs 2-4 queued -> close: 2-4 fail at once, 1 finishes once released
    rig, gate = gated_rig()
    mover = rig.mover
    first = mover.submit(BlockTransfer(Direction.SAVE, [0], [0]))
    assert gate.entered.wait(SETTLE)
    queued = [mover.submit(BlockTransfer(Direction.SAVE, [b], [b])) for b in (1, 2, 3)]
    mover.close(timeout=0.05)
    results = mover.wait(queued, SETTLE)
    assert all(r.error == "the mover closed before the copy ran" for r in results)
    assert all(r.failed == (0,) for r in results)
    gate.opened.set()
    (held,) = mover.wait([first], SETTLE)
    assert held.ok
    with pytest.raises(UsageError, match="closed"):
        mover.submit(BlockTransfer(Direction.SAVE, [0], [0]))
    mover.close()


def test_a_closed_mover_reopens_once_its_running_copy_has_ended() -> None:
    rig, gate = gated_rig()
    mover = rig.mover
    assert mover.reopen()  # an open mover is open
    held = mover.submit(BlockTransfer(Direction.LOAD, [0], [0]))
    assert gate.entered.wait(SETTLE)
    mover.close(timeout=0.05)  # the held copy goes on running
    assert not mover.reopen()
    with pytest.raises(UsageError, match="closed"):
        mover.submit(BlockTransfer(Direction.SAVE, [1], [1]))
    gate.opened.set()
    assert mover.wait([held], SETTLE)[0].ok
    assert mover.reopen()
    assert isinstance(mover, SupportsReopen)
    job = mover.submit(BlockTransfer(Direction.SAVE, [5, 6], [7, 8]))  # on a fresh lane, ids going on
    assert job == held + 1
    assert mover.wait([job], SETTLE)[0].ok
    assert (rig.host_block(7), rig.host_block(8)) == (rig.engine_block(5), rig.engine_block(6))
    mover.close()
    rig.host.close()
    with pytest.raises(UsageError, match="host memory is closed"):
        mover.reopen()


def test_close_is_idempotent_and_every_job_gets_a_result(rig: Rig) -> None:
    jobs = [rig.mover.submit(BlockTransfer(Direction.SAVE, [b], [b])) for b in range(8)]
    rig.mover.close()
    rig.mover.close()
    results = rig.mover.wait(jobs, SETTLE)
    assert [r.job_id for r in results] == jobs
    assert all(r.ok or r.error == "the mover closed before the copy ran" for r in results)


# -- host memory ---------------------------------------------------------------------------------------


def test_host_memory_is_exactly_the_size_asked_for() -> None:
    # 3 blocks of 1000 bytes -> 3000 bytes, no power-of-two rounding
    with HostMemory.allocate(3, 1000, torch.device("cpu")) as host:
        assert host.nbytes == 3000
        assert host.buffer.untyped_storage().nbytes() == 3000
        assert host.blocks.shape == (3, 1000)
        assert not host.pinned


@pytest.mark.parametrize(("blocks", "block_bytes", "field"), [(0, 64, "num_blocks"), (4, -1, "block_bytes")])
def test_host_memory_refuses_empty_sizes(blocks: int, block_bytes: int, field: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"^{field}: got {block_bytes if field == 'block_bytes' else blocks}"
    ):
        HostMemory.allocate(blocks, block_bytes, torch.device("cpu"))


def test_pool_holds_whole_chunks_and_refuses_less_than_one() -> None:
    # 10_000 bytes, chunks of 4 blocks x 512 bytes = 2048 -> 4 slots (16 host blocks)
    layout = KVLayout(
        kind=LayoutKind.VLLM_CPU, num_blocks=8, block_tokens=16, num_kv_heads=1, head_size=8, dtype_size=2
    )
    engine = EngineSpec(model_id="m", kv_dtype="bfloat16", num_layers=1, total_kv_heads=1, layout=layout)

    def config(size: int) -> KVCoreConfig:
        return load_config({"backend": {"kind": "cpu", "size": size}, "chunk_tokens": 64})

    assert pool_slots(config(10_000), engine) == 4
    # size is the total across ranks: 2 heads on 2 ranks, each rank's slot as big as above
    tp2 = attrs.evolve(engine, total_kv_heads=2, tp_size=2)
    assert pool_slots(config(10_000), tp2, world_size=2) == 2
    with pytest.raises(ConfigError, match=r"^backend.size: got 2000, expected at least 2048 bytes"):
        pool_slots(config(2000), engine)


# -- a refused submit leaves no job; an accepted one always ends ---------------------------------------


def raw_transfer(direction: object, engine: tuple[object, ...], host: tuple[object, ...]) -> BlockTransfer:
    """A BlockTransfer holding exactly these values, as one built without the port's converters would."""
    transfer = BlockTransfer(Direction.SAVE, (), ())
    for name, value in (("direction", direction), ("engine_blocks", engine), ("host_blocks", host)):
        object.__setattr__(transfer, name, value)
    return transfer


def assert_never_issued(mover: TorchBlockMover, job_id: int) -> None:
    """``job_id`` is not pending: a wait on it returns nothing at once instead of timing out."""
    assert mover.wait([JobId(job_id)], 0.05) == ()


class QueueFails(FaultHooks):
    """The next queued copy raises ``error`` where it is queued (``before_queue``); later ones queue."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def before_queue(self, direction: Direction, items: int) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error


@pytest.fixture
def queue_fails() -> Iterator[tuple[Rig, QueueFails]]:
    faults = QueueFails()
    made = make_rig(faults=faults)
    yield made, faults
    made.mover.close()


def test_a_queue_that_refuses_a_job_leaves_nothing_pending(queue_fails: tuple[Rig, QueueFails]) -> None:
    rig, faults = queue_fails
    before = rig.mover.submit(BlockTransfer(Direction.SAVE, [0], [0]))
    faults.error = UsageError("the lane is closed")
    with pytest.raises(UsageError, match="the lane is closed"):
        rig.mover.submit(BlockTransfer(Direction.SAVE, [1], [1]))
    after = rig.mover.submit(BlockTransfer(Direction.SAVE, [2], [2]))
    assert after == before + 2
    assert_never_issued(rig.mover, before + 1)
    assert [r.job_id for r in rig.mover.wait([before, after], SETTLE)] == [before, after]
    assert rig.mover.poll() == ()


def test_a_queue_that_fails_to_take_a_job_fails_it(queue_fails: tuple[Rig, QueueFails]) -> None:
    rig, faults = queue_fails
    faults.error = RuntimeError("CUDA error: launch failure")
    job = rig.mover.submit(BlockTransfer(Direction.LOAD, [1, 2], [1, 2]))
    (result,) = rig.mover.wait([job], SETTLE)
    assert result.failed == (0, 1)
    assert result.error == "RuntimeError: CUDA error: launch failure"
    again = rig.mover.submit(BlockTransfer(Direction.LOAD, [1, 2], [1, 2]))
    assert rig.mover.wait([again], SETTLE)[0].ok


def test_an_interrupted_submit_leaves_nothing_pending(queue_fails: tuple[Rig, QueueFails]) -> None:
    rig, faults = queue_fails
    before = rig.mover.submit(BlockTransfer(Direction.SAVE, [0], [0]))
    faults.error = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        rig.mover.submit(BlockTransfer(Direction.SAVE, [1], [1]))
    assert_never_issued(rig.mover, before + 1)


@pytest.mark.parametrize(
    ("direction", "engine_ids", "host_ids", "message"),
    [
        ("save", (0,), (0,), r"^direction: got 'save', expected a Direction"),
        (Direction.SAVE, (1.7,), (0,), r"^engine_blocks: got 1.7, expected integer block ids"),
        (Direction.SAVE, (0,), (2.0,), r"^host_blocks: got 2.0, expected integer block ids"),
        (Direction.LOAD, (True,), (0,), r"^engine_blocks: got True, expected integer block ids"),
        (Direction.LOAD, ("3",), (0,), r"^engine_blocks: got '3', expected integer block ids"),
        (Direction.SAVE, (2**70,), (0,), rf"^engine_blocks: block {2**70} is outside \[0, {ENGINE_BLOCKS}\)"),
        (
            Direction.SAVE,
            (0,),
            (-(2**64),),
            rf"^host_blocks: block {-(2**64)} is outside \[0, {HOST_BLOCKS}\)",
        ),
        (Direction.LOAD, (0, 1, True), (0, 1, 2), r"^engine_blocks: got True, expected integer block ids"),
        (Direction.SAVE, (0, 1, 2), (2, -1, 0), rf"^host_blocks: block -1 is outside \[0, {HOST_BLOCKS}\)"),
        (
            Direction.SAVE,
            (np.uint64(2**64 - 1),),
            (0,),
            rf"^engine_blocks: block {2**64 - 1} is outside \[0, {ENGINE_BLOCKS}\)",
        ),
    ],
    ids=[
        "str-direction",
        "float",
        "integral-float",
        "bool",
        "str",
        "huge",
        "huge-negative",
        "bool-among-ints",
        "negative-among-ints",
        "uint64-max",
    ],
)
def test_what_numpy_would_truncate_or_misread_is_refused(
    rig: Rig, direction: object, engine_ids: tuple[object, ...], host_ids: tuple[object, ...], message: str
) -> None:
    # built past BlockTransfer's converters: the mover checks what it is given, whatever built it
    host = rig.host_blocks()
    last = rig.mover.submit(BlockTransfer(Direction.SAVE, [], []))
    with pytest.raises(InvalidSpecError, match=message):
        rig.mover.submit(raw_transfer(direction, engine_ids, host_ids))
    assert_never_issued(rig.mover, last + 1)
    assert rig.host_blocks() == host


def test_numpy_integer_ids_are_block_ids(rig: Rig) -> None:
    assert rig.run(Direction.SAVE, list(np.arange(3, 6)), list(np.arange(3))).ok
    assert [rig.host_block(h) for h in range(3)] == [rig.engine_block(e) for e in range(3, 6)]


def test_what_is_not_a_block_transfer_is_refused(rig: Rig) -> None:
    with pytest.raises(InvalidSpecError, match=r"^transfer: got tuple, expected a BlockTransfer"):
        rig.mover.submit((Direction.SAVE, [0], [0]))  # type: ignore[arg-type]  # wrong on purpose


@pytest.mark.parametrize("timeout", [math.inf, math.nan, -1.0, True, "1"], ids=repr)
def test_every_wait_is_bounded(rig: Rig, timeout: object) -> None:
    job = rig.mover.submit(BlockTransfer(Direction.LOAD, [0], [0]))
    expected = rf"^timeout: got {re.escape(repr(timeout))}, expected a finite number of seconds >= 0"
    with pytest.raises(ConfigError, match=expected):
        rig.mover.wait([job], timeout)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=expected):
        rig.mover.wait_loaded(job, timeout)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=expected):
        rig.mover.close(timeout)  # type: ignore[arg-type]
    assert rig.mover.wait([job], SETTLE)[0].ok


# -- construction, closed objects, threads ---------------------------------------------------------------


@pytest.mark.parametrize("threads", [0, 65, True, 2.0, "2"], ids=repr)
def test_copy_threads_is_an_int_in_range(threads: object) -> None:
    layout = make_layout(LayoutKind.MLA)
    engine = EngineKV.register(random_kv(layout, shared=True), layout)
    host = HostMemory.allocate(4, engine.host_block_bytes, engine.device)
    with pytest.raises(
        ConfigError, match=rf"^copy_threads: got {re.escape(repr(threads))}, expected an int in \[1, 64\]"
    ):
        TorchBlockMover(engine, host, copy_threads=threads)  # type: ignore[arg-type]


def test_the_engine_and_host_must_be_what_they_say() -> None:
    layout = make_layout(LayoutKind.MLA)
    engine = EngineKV.register(random_kv(layout, shared=True), layout)
    host = HostMemory.allocate(4, engine.host_block_bytes, engine.device)
    with pytest.raises(InvalidSpecError, match=r"^engine: got list, expected an EngineKV"):
        TorchBlockMover(random_kv(layout, shared=True), host)  # type: ignore[arg-type]
    with pytest.raises(InvalidSpecError, match=r"^host: got Tensor, expected a HostMemory"):
        TorchBlockMover(engine, host.buffer)  # type: ignore[arg-type]
    host.close()
    with pytest.raises(UsageError, match=r"^host: the host memory is closed"):
        TorchBlockMover(engine, host)


def test_the_copy_threads_end_with_close_and_the_worker_is_a_daemon() -> None:
    # 96 blocks of 3 layers x 32 KiB: large enough for the copy helper to start as well
    before = set(threading.enumerate())
    rig = make_rig(LayoutKind.VLLM_CPU, blocks=128, host_blocks=128, tokens=512)
    assert rig.run(Direction.SAVE, list(range(96)), list(range(96))).ok
    started = set(threading.enumerate()) - before
    assert {t.name for t in started} >= {"kvcore-mover", "kvcore-copy_0"}
    assert all(t.daemon for t in started if t.name == "kvcore-mover")
    rig.mover.close()
    for thread in started:
        thread.join(SETTLE)
    assert not any(t.is_alive() for t in started)


def test_a_closed_lane_refuses_jobs_instead_of_queueing_them_for_no_one() -> None:
    rig = make_rig()
    board = JobBoard()
    lane = CpuLane(board, BlockCopier([routes(rig.engine)], rig.host, 1))
    lane.close(SETTLE)
    lane.close(SETTLE)  # idempotent
    job = board.new()
    ids = np.zeros(1, dtype=np.int64)
    with pytest.raises(UsageError, match="closed"):
        lane.start(job, Direction.LOAD, ids, ids, None)
    lane.wait_loaded(job, 0)  # never queued: nothing to wait for
    rig.mover.close()


@pytest.mark.parametrize("size", [0, 1, -1], ids=["empty", "one-byte", "one-block-less-one"])
def test_a_mapped_mover_refused_leaves_the_mapping_free_to_close(size: int) -> None:
    # -1: one byte short of a host block; the refused mover holds no export, so the owner can unmap
    layout = make_layout(LayoutKind.FLASH_ATTN)
    engine = EngineKV.register(random_kv(layout, shared=False), layout)
    length = engine.host_block_bytes - 1 if size == -1 else size
    buffer = bytearray(length) if length == 0 else mmap.mmap(-1, length)
    with pytest.raises(ConfigError, match=rf"^buffer: got {length}, expected at least one block"):
        MappedMover(engine, buffer)
    if isinstance(buffer, mmap.mmap):
        buffer.close()


# -- head blocks (a remote tier that keeps a value per KV head) ----------------------------------------


@pytest.mark.parametrize("shared", [True, False], ids=["one-storage", "tensor-per-layer"])
@pytest.mark.parametrize("heads", [2, 4])
@pytest.mark.parametrize(
    "kind", [LayoutKind.VLLM_CPU, LayoutKind.PAGED, LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER]
)
def test_a_head_mover_moves_exactly_one_heads_runs(kind: LayoutKind, heads: int, shared: bool) -> None:
    layout = KVLayout(kind, ENGINE_BLOCKS, 4, heads, head_size=16, dtype_size=2, head_order=HeadOrder.HND)
    engine = EngineKV.register(random_kv(layout, shared=shared, seed=heads), layout)
    runs = HeadRuns.of_layout(layout, LAYERS)
    assert runs is not None
    size = runs.head_bytes
    assert size * heads == engine.host_block_bytes
    pool = mmap.mmap(-1, 4 * size)
    mover = MappedMover(engine, pool, per_head=True)
    try:

        def whole(block: int) -> bytes:
            return b"".join(plane[block].numpy().tobytes() for plane in engine.planes)

        def head_of(data: bytes, head: int) -> bytes:
            return b"".join(data[start : start + length] for start, length in runs.runs[head])

        for head in range(heads):
            job = mover.submit_after(BlockTransfer(Direction.SAVE, [5, 9], [1, 0], head=head), mover.mark())
            assert mover.wait([job], SETTLE)[0].ok
            assert pool[size : 2 * size] == head_of(whole(5), head)
            assert pool[0:size] == head_of(whole(9), head)
            before = whole(3)
            job = mover.submit_after(BlockTransfer(Direction.LOAD, [3], [1], head=head), mover.mark())
            assert mover.wait([job], SETTLE)[0].ok
            after = whole(3)
            assert head_of(after, head) == head_of(whole(5), head)
            for other in set(range(heads)) - {head}:
                assert head_of(after, other) == head_of(before, other), f"head {other} was touched"
        for bad in (None, heads, -1):
            with pytest.raises(InvalidSpecError, match="head: got"):
                mover.submit_after(BlockTransfer(Direction.SAVE, [1], [0], head=bad), mover.mark())
    finally:
        mover.close()
    whole_mover = MappedMover(engine, mmap.mmap(-1, engine.host_block_bytes))
    try:
        with pytest.raises(InvalidSpecError, match="head: got 0, expected None"):
            whole_mover.submit(BlockTransfer(Direction.SAVE, [1], [0], head=0))
    finally:
        whole_mover.close()


def test_a_head_mover_refuses_heads_that_are_not_runs() -> None:
    layout = make_layout(LayoutKind.FLASH_ATTN)
    assert layout.head_order is HeadOrder.NHD
    engine = EngineKV.register(random_kv(layout, shared=False), layout)
    with pytest.raises(InvalidSpecError, match="per_head: the engine's 2 KV heads are not runs"):
        MappedMover(engine, mmap.mmap(-1, engine.host_block_bytes), per_head=True)
