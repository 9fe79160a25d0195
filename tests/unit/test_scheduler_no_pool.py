"""The scheduler and worker with a remote tier and no local pool (``num_slots=0``): every load and save is
one remote job that moves the engine's blocks itself. The remote tier here is an in-memory fake; the same
paths run against a real LMCache server in ``tests/lmcache/test_direct.py``."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from functools import partial

import pytest

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import ConfigError
from kvcore.execution.remote import ManagedRemote, StoreRemote
from kvcore.execution.worker import BlockWorker
from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.jobs import JobBoard, JobResult
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.ports import BlockItem, StoreItem
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore.testing.memory import (
    InMemoryBlockMover,
    InMemoryBlockTransferTier,
    InMemoryChunkStore,
    InMemoryManagedTier,
    InMemoryStoreIndex,
)

LAYOUT = KVLayout(
    kind=LayoutKind.VLLM_CPU, num_blocks=64, block_tokens=4, num_kv_heads=2, head_size=2, dtype_size=1
)
ENGINE = EngineSpec(model_id="tiny", kv_dtype="int8", num_layers=2, total_kv_heads=2, layout=LAYOUT)
CONFIG = load_config({"backend": {"kind": "lmcache_mp"}, "chunk_tokens": 8, "partial_chunks": "drop"})
TAILS = load_config({"backend": {"kind": "lmcache_mp"}, "chunk_tokens": 8})  # the default: tails kept
TOKENS = list(range(100, 130))  # 30 tokens: 3 full chunks of 8 (2 blocks each), then 6 tokens
PER_CHUNK = 2


class BlockMovingTier:
    """A remote tier keeping chunk and tail values, moving them to and from an engine's blocks itself."""

    def __init__(self, values: dict[ChunkKey, bytes], engine: InMemoryBlockMover) -> None:
        self.values = values
        self.engine = engine
        self.board = JobBoard()
        self.fail: int | None = None  # the index of an item the next fetch fails
        self.abandoned: list[JobId] = []
        self.copying = False  # what ``abandon`` answers: whether a copy into engine blocks runs
        self.hold = False  # jobs stay in flight until ``release``
        self.held: list[JobResult] = []

    def submit_fetch_blocks(
        self, session: str, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        size = self.engine.host_block_bytes
        failed = []
        for i, item in enumerate(items):
            value = self.values.get(item.key)
            size_ok = value is not None and len(value) == (item.value_blocks or PER_CHUNK) * size
            if value is None or not size_ok or i == self.fail:
                failed.append(i)
                continue
            for n, block in enumerate(item.engine_blocks):
                at = (item.first + n) * size
                self.engine.write_engine_block(block, value[at : at + size])
        return self._finish(failed)

    def submit_publish_blocks(
        self, session: str, items: Sequence[BlockItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        for item in items:
            assert (item.first, len(item.engine_blocks)) == (
                0,
                item.value_blocks or PER_CHUNK,
            )  # whole values
            self.values.setdefault(
                item.key, b"".join(self.engine.read_engine_block(b) for b in item.engine_blocks)
            )
        return self._finish([])

    def submit_fetch(self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()) -> JobId:
        raise AssertionError("a direct op never names host bytes")

    submit_publish = submit_fetch

    def abandon(self, job_id: JobId) -> bool:
        self.abandoned.append(job_id)
        return self.copying

    def adopt(self, session: str, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        """This tier takes no locks."""

    def end_session(self, session: str) -> None:
        pass

    def close(self) -> None:
        """Nothing to release: a test's tier lives in memory."""

    def poll(self) -> tuple[JobResult, ...]:
        return self.board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self.board.wait(job_ids, timeout)

    def _finish(self, failed: list[int]) -> JobId:
        job = self.board.new()
        if self.hold:
            self.held.append(JobResult(job, tuple(failed)))
        else:
            self.board.finish(JobResult(job, tuple(failed)))
        return job

    def release(self) -> None:
        for result in self.held:
            self.board.finish(result)
        self.held.clear()


def _holds(values: dict[ChunkKey, bytes], keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
    """What the tier's index answers from: whether it keeps each key's value."""
    return tuple(key in values for key in keys)


class Engine:
    """A scheduler with no pool and its worker with no mover, over a shared value store."""

    def __init__(self, values: dict[ChunkKey, bytes], config: KVCoreConfig = CONFIG) -> None:
        self.kv = InMemoryBlockMover(
            num_engine_blocks=64, num_host_blocks=1, layer_block_bytes=LAYOUT.block_bytes, num_layers=2
        )
        self.tier = BlockMovingTier(values, self.kv)
        self.sched = CacheScheduler(config, ENGINE, 0, remote=InMemoryStoreIndex(partial(_holds, values)))
        self.worker = BlockWorker(None, remote=self.tier)

    def step(self) -> None:
        plan = self.sched.take_plan()
        for op in plan.ops:
            assert op.host_blocks == ()
            assert all(c.slot is None for c in op.remote)
        self.worker.execute(plan)
        self.sched.complete(self.worker.wait(plan.op_ids(), 5.0))

    def lookup(self, rid: str, tokens: Sequence[int] = TOKENS, local_tokens: int = 0) -> int:
        for _ in range(100):
            hits = self.sched.lookup(RequestId(rid), tokens=tokens, local_tokens=local_tokens)
            if hits is not None:
                return hits
        raise AssertionError("the lookup never answered")

    def fill(self, blocks: Sequence[int]) -> list[bytes]:
        data = [os.urandom(self.kv.host_block_bytes) for _ in blocks]
        for block, value in zip(blocks, data, strict=True):
            self.kv.write_engine_block(block, value)
        return data

    def read(self, blocks: Sequence[int]) -> list[bytes]:
        return [self.kv.read_engine_block(b) for b in blocks]


def _saved(values: dict[ChunkKey, bytes]) -> tuple[Engine, list[bytes]]:
    a = Engine(values)
    assert a.lookup("a") == 0
    data = a.fill(range(6))
    assert a.sched.save(RequestId("a"), range(7), num_tokens=30) == 3
    a.step()
    a.sched.finish(RequestId("a"))
    assert a.sched.stats().saved_blocks == 6
    return a, data


def test_blocks_go_from_one_engine_to_another_through_the_remote_tier_alone() -> None:
    values: dict[ChunkKey, bytes] = {}
    a, data = _saved(values)
    assert len(values) == 3
    b = Engine(values)
    rid = RequestId("b")
    assert b.lookup("b") == 24
    assert b.sched.start_load(rid, range(30, 37)) == 24
    b.step()
    assert b.read(range(30, 36)) == data
    assert b.sched.take_load_errors() == {}
    assert b.sched.extra_cached_tokens(rid) == 24
    usage = b.sched.stats().pool
    assert (usage.capacity, usage.used, usage.pinned, usage.storing) == (0, 0, 0, 0)
    b.sched.finish(rid)
    assert (b.sched.stats().requests, b.sched.in_flight(), a.sched.in_flight()) == (0, 0, 0)


def test_without_a_pool_the_prompts_tail_goes_to_the_remote_tier_and_serves_another_engine() -> None:
    values: dict[ChunkKey, bytes] = {}
    a, rid = Engine(values, TAILS), RequestId("a")
    assert a.lookup("a") == 0
    data = a.fill(range(7))
    assert a.sched.save(rid, range(8), num_tokens=30) == 4  # three chunks and the tail (block 6)
    a.step()
    a.sched.finish(rid)
    assert (
        sorted(len(v) for v in values.values()) == [a.kv.host_block_bytes] + [2 * a.kv.host_block_bytes] * 3
    )
    b, other = Engine(values, TAILS), RequestId("b")
    assert b.lookup("b") == 28  # the tail's block too: the engine computes 2 tokens, not 6
    assert b.sched.load_reads_remote(other)
    assert b.sched.start_load(other, range(30, 38)) == 28
    b.step()
    assert b.read(range(30, 37)) == data
    assert b.sched.take_load_errors() == {}
    assert b.sched.save(other, range(30, 38), num_tokens=30) == 0  # the lookup found all of it
    b.sched.finish(other)
    # a prompt that diverges inside the tail's block finds the chunks only
    assert Engine(values, TAILS).lookup("c", tokens=[*TOKENS[:25], 7, 7, 7, 7, 7]) == 24


def test_a_load_starting_inside_a_chunk_moves_the_rest_of_it() -> None:
    values: dict[ChunkKey, bytes] = {}
    _, data = _saved(values)
    b = Engine(values)
    assert b.lookup("b", local_tokens=4) == 20  # the engine holds the first block
    b.sched.start_load(RequestId("b"), range(40, 47))
    b.step()
    assert b.read(range(41, 46)) == data[1:]
    assert b.read([40]) == [bytes(b.kv.host_block_bytes)]  # never written


def test_chunks_the_lookup_found_are_not_saved_again() -> None:
    values: dict[ChunkKey, bytes] = {}
    a, _ = _saved(values)
    assert a.lookup("again", tokens=list(range(100, 132))) == 24  # 4 full chunks, 3 of them held
    assert a.sched.save(RequestId("again"), range(8), num_tokens=32) == 1  # only the 4th one is new
    a.step()
    assert len(values) == 4


def test_a_retry_without_a_pool_counts_the_chunks_it_sends_again_once() -> None:
    # without a pool, a retry sends again every chunk after the first failed one, which the tier holds
    # already: those count once, in saved blocks and in the tier's stored chunks
    kv = InMemoryBlockMover(
        num_engine_blocks=64, num_host_blocks=1, layer_block_bytes=LAYOUT.block_bytes, num_layers=2
    )
    tier = InMemoryBlockTransferTier(bytearray(1), engine=kv, blocks_per_chunk=PER_CHUNK)
    index = InMemoryStoreIndex(lambda keys: tuple(tier.peek(key) is not None for key in keys))
    sched = CacheScheduler(CONFIG, ENGINE, 0, remote=index)
    worker = BlockWorker(None, remote=ManagedRemote(tier))
    a = RequestId("a")
    answers = (sched.lookup(a, tokens=TOKENS) for _ in range(100))  # the index answers on a later ask
    assert next(hits for hits in answers if hits is not None) == 0
    for block in range(6):
        kv.write_engine_block(block, os.urandom(kv.host_block_bytes))
    tier.fail_next(1)  # the first chunk's store
    sent: list[int] = []
    for _ in range(2):
        sent.append(sched.save(a, range(7), num_tokens=30))
        plan = sched.take_plan()
        worker.execute(plan)
        sched.complete(worker.wait(plan.op_ids(), 5.0))
    (op,) = plan.ops
    held = [tier.peek(key) for chunk in op.remote for key in chunk.keys if key is not None]
    assert len(held) == 3  # the retry's three chunks, the tier holding each
    assert None not in held
    stats = sched.stats()
    assert sent == [3, 3]  # the retry sent the stored chunks 1 and 2 again, with chunk 0
    assert (stats.failed_save_chunks, stats.save_retries) == (1, 1)
    assert (stats.saved_blocks, stats.tier_stored) == (3 * PER_CHUNK, (3,))


def test_sightings_are_counted_without_a_pool() -> None:
    config = load_config({"backend": {"kind": "lmcache_mp"}, "chunk_tokens": 8, "save_after_sightings": 2})
    sched = CacheScheduler(config, ENGINE, 0, remote=InMemoryStoreIndex(partial(_holds, {})))
    saved = []
    for rid in ("first", "second"):
        for _ in range(100):
            if sched.lookup(RequestId(rid), tokens=TOKENS) is not None:
                break
        saved.append(sched.save(RequestId(rid), range(7), num_tokens=30))
    assert saved == [0, 4]  # saved once a second request asked for the chunks (and the prompt's tail)


def _loading() -> tuple[Engine, RequestId]:
    """Engine B with the load of what engine A saved started (engine blocks 30 on), not yet stepped."""
    values: dict[ChunkKey, bytes] = {}
    _saved(values)
    b = Engine(values)
    rid = RequestId("b")
    assert b.lookup("b") == 24
    b.sched.start_load(rid, range(30, 37))
    return b, rid


def test_a_failed_fetch_is_recomputed_and_not_counted_as_served() -> None:
    b, rid = _loading()
    b.tier.fail = 2  # the last chunk's value is lost on the way
    b.step()
    assert set(b.sched.take_load_errors()[rid]) == {34, 35}
    assert b.sched.extra_cached_tokens(rid) == 16


def test_a_remote_tier_that_cannot_move_blocks_fails_the_op_and_leaks_nothing() -> None:
    values: dict[ChunkKey, bytes] = {}
    _saved(values)
    b = Engine(values)
    mover = InMemoryBlockMover(num_engine_blocks=64, num_host_blocks=2, layer_block_bytes=LAYOUT.block_bytes)
    b.worker = BlockWorker(None, remote=StoreRemote(InMemoryChunkStore(mover.host)))  # misconfigured
    rid = RequestId("b")
    assert b.lookup("b") == 24
    b.sched.start_load(rid, range(30, 37))
    b.step()
    assert set(b.sched.take_load_errors()[rid]) == set(range(30, 36))
    b.sched.finish(rid)
    assert (b.sched.stats().requests, b.sched.in_flight()) == (0, 0)


def test_an_abandoned_save_in_flight_is_abandoned_on_the_tier_and_reported_failed() -> None:
    values: dict[ChunkKey, bytes] = {}
    a = Engine(values)
    rid = RequestId("a")
    assert a.lookup("a") == 0
    a.sched.save(rid, range(7), num_tokens=30)
    plan = a.sched.take_plan()
    a.tier.hold = True
    a.worker.execute(plan)
    (op,) = plan.ops
    a.worker.fence([op.op_id])  # e.g. the request was preempted and the copy is late
    assert len(a.tier.abandoned) == 1
    a.tier.release()
    (report,) = a.worker.wait([op.op_id], 5.0)
    assert report.failed == tuple(range(6))


@pytest.mark.parametrize("copying", [False, True], ids=["not-copying", "copying"])
def test_an_abandoned_direct_load_is_awaited_only_while_the_tier_copies(copying: bool) -> None:
    b, _ = _loading()
    plan = b.sched.take_plan()
    b.tier.hold = True
    b.tier.copying = copying
    b.worker.execute(plan)
    (op,) = plan.ops
    assert b.worker.abandon([op.op_id]) == ([op.op_id] if copying else [])
    assert b.tier.abandoned == [JobId(1)]
    b.tier.release()
    (report,) = b.worker.wait([op.op_id], 5.0)
    assert report.failed == tuple(range(6))  # given up: failed whatever the tier did


def test_a_managed_tier_without_block_moves_refuses_them() -> None:
    remote = ManagedRemote(InMemoryManagedTier(bytearray(64)))
    with pytest.raises(Exception, match="cannot move engine blocks"):
        remote.submit_fetch_blocks("s", [BlockItem(ChunkKey("k"), (0,))])


def test_no_pool_and_no_remote_tier_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        CacheScheduler(CONFIG, ENGINE, 0)
    assert info.value.field == "num_slots"
