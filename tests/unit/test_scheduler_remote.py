"""The scheduler and worker with a remote tier behind the local pool (in-memory store and index):
fetch after local eviction, publish per rank shard, misses and failures, epoch bump on reset."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import attrs
import pytest

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import BackendUnavailable
from kvcore.execution.remote import StoreRemote
from kvcore.execution.worker import BlockWorker
from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.step import BlockOp, RemoteChunk, StepPlan
from kvcore.ports import Direction, RemoteTier, StoreItem
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore.testing.memory import (
    InMemoryBlockMover,
    InMemoryChunkIndex,
    InMemoryChunkStore,
    InMemoryStoreIndex,
)

LAYOUT = KVLayout(
    kind=LayoutKind.VLLM_CPU, num_blocks=64, block_tokens=4, num_kv_heads=2, head_size=2, dtype_size=1
)
ENGINE = EngineSpec(model_id="tiny", kv_dtype="int8", num_layers=2, total_kv_heads=2, layout=LAYOUT)
TOKENS = list(range(100, 130))  # 30 tokens: 3 full chunks of 8, then 6 tokens
OTHER = list(range(1000, 1030))
CONFIG = load_config(
    {"backend": {"kind": "cpu", "size": 1 << 20}, "chunk_tokens": 8, "partial_chunks": "drop"}
)


def answer(sched: CacheScheduler, rid: str, tokens: Sequence[int]) -> int:
    for _ in range(100):
        if (hits := sched.lookup(RequestId(rid), tokens=tokens)) is not None:
            return hits
    raise AssertionError("the lookup never answered")


class Rig:
    """A scheduler and one worker over an in-memory mover, the store behind them as the remote tier
    (``tier`` wraps it: ``StoreRemote``, or a cascade of it; ``write_back``: that tier is written back)."""

    def __init__(
        self,
        slots: int = 3,
        config: KVCoreConfig = CONFIG,
        tier: Callable[[InMemoryChunkStore], RemoteTier] = StoreRemote,
        *,
        write_back: bool = False,
    ) -> None:
        self.mover = InMemoryBlockMover(
            num_engine_blocks=64,
            num_host_blocks=slots * 2,
            layer_block_bytes=LAYOUT.block_bytes,
            num_layers=2,
        )
        self.store = InMemoryChunkStore(self.mover.host)
        self.index = InMemoryStoreIndex(self.store.exists)
        self.sched = CacheScheduler(config, ENGINE, slots, remote=self.index, write_back=write_back)
        slot_bytes = 2 * self.mover.host_block_bytes
        self.worker = BlockWorker(self.mover, remote=tier(self.store), slot_bytes=slot_bytes, slot_blocks=2)

    def step(self) -> StepPlan:
        plan = self.sched.take_plan()
        self.worker.execute(plan)
        self.sched.complete(self.worker.wait(plan.op_ids(), 5.0))
        return plan

    def lookup(self, rid: str, tokens: Sequence[int]) -> int:
        """Ask until the answer is in (a remote lookup answers on a later ask)."""
        return answer(self.sched, rid, tokens)

    def serve_and_save(self, rid: str, tokens: Sequence[int], blocks: Sequence[int]) -> dict[int, bytes]:
        assert self.lookup(rid, tokens) == 0
        data = {}
        for b in blocks:
            data[b] = os.urandom(self.mover.host_block_bytes)
            self.mover.write_engine_block(b, data[b])
        self.sched.save(RequestId(rid), blocks, num_tokens=len(tokens))
        self.step()
        self.sched.finish(RequestId(rid))
        return data


def test_a_chunk_evicted_locally_is_fetched_from_the_remote_tier_byte_exact() -> None:
    rig = Rig(slots=3)
    saved = rig.serve_and_save("a", TOKENS, range(8))  # 3 chunks, published to the store too
    rig.serve_and_save("b", OTHER, range(8, 16))  # evicts a's chunks from the 3-slot pool
    assert rig.sched.stats().pool.evictions == 3
    c = RequestId("c")
    assert rig.lookup(c, TOKENS) == 24  # all from the remote tier
    assert rig.sched.load_reads_remote(c)  # worth an asynchronous load
    rig.sched.start_load(c, range(20, 28))
    plan = rig.step()
    assert [len(op.remote) for op in plan.ops] == [3]
    assert [rig.mover.read_engine_block(20 + i) for i in range(6)] == [saved[i] for i in range(6)]
    assert rig.sched.take_load_errors() == {}
    assert rig.sched.extra_cached_tokens(c) == 24
    # the fetched chunks stay in the local pool: the next lookup needs no remote answer
    with rig.index.outage():
        assert rig.lookup("d", TOKENS) == 24
    assert not rig.sched.load_reads_remote(RequestId("d"))  # all from the host pool
    assert not rig.sched.load_reads_remote(RequestId("nobody"))
    assert rig.sched.stats().pool.pinned == 0


def test_requests_on_one_prefix_wait_for_the_asynchronous_load_in_flight_instead_of_loading_it_again() -> (
    None
):
    rig = Rig(slots=3)
    rig.serve_and_save("a", TOKENS, range(8))
    rig.serve_and_save("b", OTHER, range(8, 16))  # a's chunks only in the store now
    c, d, e = RequestId("c"), RequestId("d"), RequestId("e")
    assert rig.lookup(c, TOKENS) == 24
    rig.sched.start_load(c, range(20, 28), is_async=True)
    plan = rig.sched.take_plan()  # c's load in flight: its blocks are not in the engine's cache yet
    # d would read what c's load brings: however often it asks, it waits
    assert all(rig.sched.lookup(d, tokens=TOKENS) is None for _ in range(20))
    assert rig.lookup(e, OTHER) == 24  # another prefix: no wait
    rig.worker.execute(plan)
    rig.sched.complete(rig.worker.wait(plan.op_ids(), 5.0))
    # c's load ended: the engine holds its blocks, so d asks from there on and loads nothing
    assert rig.sched.lookup(d, tokens=TOKENS, local_tokens=24) == 0
    assert rig.sched.stats().async_loads == 1


def test_a_synchronous_load_in_flight_makes_nobody_wait() -> None:
    # the engine has a synchronous load's blocks in its own cache at once
    rig = Rig(slots=3)
    rig.serve_and_save("a", TOKENS, range(8))
    c = RequestId("c")
    assert rig.lookup(c, TOKENS) == 24
    rig.sched.start_load(c, range(20, 28))
    rig.sched.take_plan()
    assert rig.sched.lookup(RequestId("d"), tokens=TOKENS) == 24


def test_the_local_hit_is_loaded_locally_and_the_rest_fetched() -> None:
    # pool of 4 slots: a's 3 chunks, then b's 3 chunks evict a's first two (LRU) -> a: chunk 2 local
    rig = Rig(slots=4)
    saved = rig.serve_and_save("a", TOKENS, range(8))
    rig.serve_and_save("b", OTHER, range(8, 16))
    c = RequestId("c")
    assert rig.lookup(c, TOKENS) == 24
    rig.sched.start_load(c, range(20, 28))
    plan = rig.step()
    assert [len(op.remote) for op in plan.ops] == [2]  # chunks 0 and 1 fetched; chunk 2 was still local
    assert [rig.mover.read_engine_block(20 + i) for i in range(6)] == [saved[i] for i in range(6)]


def test_a_value_gone_from_the_store_before_the_fetch_is_recomputed() -> None:
    rig = Rig(slots=3)
    rig.serve_and_save("a", TOKENS, range(8))
    rig.serve_and_save("b", OTHER, range(8, 16))
    c = RequestId("c")
    assert rig.lookup(c, TOKENS) == 24
    rig.store.clear()  # the store lost everything between the lookup and the load
    rig.sched.start_load(c, range(20, 28))
    rig.step()
    assert set(rig.sched.take_load_errors()[c]) == set(range(20, 26))
    assert rig.sched.extra_cached_tokens(c) == 0
    usage = rig.sched.stats().pool
    # the fetches evicted b's chunks for their slots, then gave the slots back: nothing pinned or held
    assert (usage.pinned, usage.used) == (0, 0)


def test_a_remote_index_that_is_down_leaves_the_local_hit() -> None:
    rig = Rig(slots=4)
    rig.serve_and_save("a", TOKENS, range(8))
    rig.serve_and_save("b", OTHER, range(8, 16))  # a keeps only chunk 2 locally: no leading local hit
    with rig.index.outage():
        assert rig.lookup("c", OTHER) == 24  # b is wholly local: no remote call
        assert rig.lookup("d", TOKENS) == 0  # remote down: a miss, not an error


def test_a_pending_remote_lookup_is_asked_again() -> None:
    store = InMemoryChunkStore(bytearray(64))
    index = InMemoryStoreIndex(store.exists)
    sched = CacheScheduler(CONFIG, ENGINE, 3, remote=index)
    a = RequestId("a")
    answer(sched, a, TOKENS)
    sched.save(a, range(8), num_tokens=30)
    for key in (k for op in sched.take_plan().ops for c in op.remote for k in c.keys if k is not None):
        store.poke(key, b"v")
    r = RequestId("r")
    with index.stall():
        assert sched.lookup(r, tokens=TOKENS) is None  # the remote answer is not in yet: ask again
        assert sched.lookup(r, tokens=TOKENS) is None
    assert answer(sched, r, TOKENS) == 24


def test_saves_publish_each_ranks_shard_and_replicas_write_once() -> None:
    # one KV head on two ranks: both hold the same shard, so one key per chunk, written by rank 0 only
    one_head = attrs.evolve(LAYOUT, num_kv_heads=1)  # what each of the two ranks holds
    engine = EngineSpec(
        model_id="tiny", kv_dtype="int8", num_layers=2, total_kv_heads=1, layout=one_head, tp_size=2
    )
    sched = CacheScheduler(CONFIG, engine, 4, world_size=2, remote=InMemoryChunkIndex())
    a = RequestId("a")
    answer(sched, a, TOKENS)
    sched.save(a, range(8), num_tokens=30)
    (op,) = sched.take_plan().ops
    assert op.direction is Direction.SAVE
    assert [c.keys[1] for c in op.remote] == [None] * 3
    assert len({c.keys[0] for c in op.remote}) == 3
    # two KV heads on two ranks: distinct shards, both write
    engine2 = EngineSpec(
        model_id="tiny", kv_dtype="int8", num_layers=2, total_kv_heads=2, layout=one_head, tp_size=2
    )
    sched2 = CacheScheduler(CONFIG, engine2, 4, world_size=2, remote=InMemoryChunkIndex())
    answer(sched2, a, TOKENS)
    sched2.save(a, range(8), num_tokens=30)
    (op2,) = sched2.take_plan().ops
    assert all(None not in c.keys and c.keys[0] != c.keys[1] for c in op2.remote)


def test_reset_moves_to_a_new_epoch_and_leaves_the_shared_store_alone() -> None:
    rig = Rig(slots=3)
    rig.serve_and_save("a", TOKENS, range(8))
    assert len(rig.store) == 3
    rig.sched.reset()
    assert rig.lookup("b", TOKENS) == 0  # old keys unreachable to this engine
    assert len(rig.store) == 3  # other engines still reach them
    rig.serve_and_save("c", TOKENS, range(8))  # saved again, under the new epoch
    assert len(rig.store) == 6


def test_a_failed_publish_drops_the_chunk_everywhere() -> None:
    # the store refuses the first of 3 puts -> that chunk is neither remote nor local (a failed save),
    # so no engine is told of a chunk the shared tier does not hold
    rig = Rig(slots=3)
    a = RequestId("a")
    assert rig.lookup("a", TOKENS) == 0
    rig.sched.save(a, range(8), num_tokens=30)
    rig.store.fail_next(1)
    rig.step()
    assert len(rig.store) == 2
    assert rig.sched.stats().failed_save_chunks == 1
    assert rig.sched.stats().pool.used == 2
    assert rig.lookup("b", TOKENS) == 0  # chunk 0 is gone: no leading hit anywhere


def test_a_save_failing_on_every_retry_counts_each_chunk_once_and_the_retries_apart() -> None:
    # two requests against a store that is down: each step saves again what failed (as vLLM asks every
    # step), and every try fails until the store is back
    rig = Rig(slots=8)
    requests = {RequestId("a"): (TOKENS, range(8)), RequestId("b"): (OTHER, range(8, 16))}
    for rid, (tokens, _) in requests.items():
        assert rig.lookup(rid, tokens) == 0

    def save_all() -> None:
        for rid, (tokens, blocks) in requests.items():
            assert rig.sched.save(rid, blocks, num_tokens=len(tokens)) == 3

    with rig.store.outage():
        for _ in range(4):
            save_all()
            rig.step()
    stats = rig.sched.stats()
    # 6 chunks lost (not 24 tries), each tried again in 3 later steps
    assert (stats.failed_save_chunks, stats.save_retries, stats.saved_blocks) == (6, 18, 0)
    save_all()  # the store is back: the next retry stores them
    rig.step()
    stats = rig.sched.stats()
    assert (stats.failed_save_chunks, stats.save_retries, stats.saved_blocks) == (6, 24, 12)
    assert (stats.tier_stored, len(rig.store)) == ((6,), 6)
    for rid, (_, blocks) in requests.items():
        assert rig.sched.save(rid, blocks, num_tokens=30) == 0  # stored: no retry left
        assert not rig.sched.finish(rid)
    assert rig.sched.stats().save_retries == 24


def test_a_later_request_of_the_same_id_counts_its_failed_saves_afresh() -> None:
    rig = Rig(slots=8)
    a = RequestId("a")
    for turn in (1, 2):
        assert rig.lookup(a, TOKENS) == 0
        with rig.store.outage():
            rig.sched.save(a, range(8), num_tokens=30)
            rig.step()
        assert not rig.sched.finish(a)  # no op in flight: forgotten at once, its chunks never stored
        stats = rig.sched.stats()
        assert (stats.failed_save_chunks, stats.save_retries, stats.requests) == (3 * turn, 0, 0)


def test_a_failed_load_is_not_tried_again_nor_counted_again() -> None:
    rig = Rig(slots=3)
    rig.serve_and_save("a", TOKENS, range(8))
    rig.serve_and_save("b", OTHER, range(8, 16))  # a's chunks now in the store alone
    c = RequestId("c")
    assert rig.lookup(c, TOKENS) == 24
    assert rig.sched.start_load(c, range(20, 28)) == 24
    rig.store.fail_next(2)  # the fetches of chunks 0 and 1
    rig.step()
    assert rig.sched.take_load_errors() == {c: (20, 21, 22, 23)}
    for _ in range(3):  # the engine asks again (as vLLM does for a request it recomputes)
        assert rig.lookup(c, TOKENS) == 0
        assert rig.sched.start_load(c, range(20, 28)) == 0
        assert rig.step().ops == ()
    stats = rig.sched.stats()
    assert (stats.failed_load_blocks, stats.loaded_blocks, stats.hit_tokens) == (4, 2, 24)


class Sessions(StoreRemote):
    """Records the sessions the worker ends."""

    def __init__(self, store: InMemoryChunkStore) -> None:
        super().__init__(store)
        self.ended: list[str] = []

    def end_session(self, session: str) -> None:
        self.ended.append(session)


def test_a_session_ends_after_the_last_op_of_its_request() -> None:
    rig = Rig(slots=3)
    remote = Sessions(rig.store)
    rig.worker = BlockWorker(
        rig.mover, remote=remote, slot_bytes=2 * rig.mover.host_block_bytes, slot_blocks=2
    )
    a = RequestId("a")
    assert rig.lookup("a", TOKENS) == 0
    rig.sched.save(a, range(8), num_tokens=30)
    assert rig.sched.finish(a) is True  # its save is in flight: the free is delayed
    plan = rig.sched.take_plan()
    assert plan.ended == (a,)
    with rig.store.stall():
        rig.worker.execute(plan)
        assert remote.ended == []  # the publish is still running
    rig.sched.complete(rig.worker.wait(plan.op_ids(), 5.0))
    assert remote.ended == [a]
    assert rig.sched.take_finished() == (a,)
    rig.worker.execute(rig.sched.take_plan())
    assert remote.ended == [a]  # once


def test_a_save_abandoned_before_its_copy_finished_is_not_published() -> None:
    rig = Rig(slots=3)
    a = RequestId("a")
    assert rig.lookup("a", TOKENS) == 0
    rig.sched.save(a, range(8), num_tokens=30)
    plan = rig.sched.take_plan()
    with rig.mover.stall():
        rig.worker.execute(plan)
        rig.worker.fence(plan.op_ids())  # the engine may overwrite the blocks from now on
    reports = rig.worker.wait(plan.op_ids(), 5.0)
    assert [r.failed for r in reports] == [tuple(range(6))]
    rig.sched.complete(reports)
    assert rig.lookup("b", TOKENS) == 0  # neither kept in the pool nor published


def test_a_worker_without_the_remote_tier_fails_the_chunks_it_cannot_fetch() -> None:
    rig = Rig(slots=3)
    rig.serve_and_save("a", TOKENS, range(8))
    rig.serve_and_save("b", OTHER, range(8, 16))
    rig.worker = BlockWorker(rig.mover)  # misconfigured: no remote tier on this worker
    c = RequestId("c")
    assert rig.lookup("c", TOKENS) == 24
    rig.sched.start_load(c, range(20, 28))
    rig.step()
    assert set(rig.sched.take_load_errors()[c]) == set(range(20, 26))  # recomputed, never garbage
    assert rig.sched.stats().pool.pinned == 0


class Chains(StoreRemote):
    """Records the chain each fetch and publish names (the store itself keys chunks alone)."""

    def __init__(self, store: InMemoryChunkStore) -> None:
        super().__init__(store)
        self.chains: list[tuple[str, tuple[ChunkKey, ...]]] = []

    def submit_fetch(self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()) -> JobId:
        self.chains.append(("fetch", tuple(chain)))
        return super().submit_fetch(session, items, chain)

    def submit_publish(
        self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        self.chains.append(("publish", tuple(chain)))
        return super().submit_publish(session, items, chain)

    def last(self) -> tuple[str, tuple[ChunkKey, ...]]:
        return self.chains[-1]


def test_ops_carry_the_chain_once_and_the_remote_lookup_its_local_prefix() -> None:
    rig = Rig(slots=5)
    remote = Chains(rig.store)
    rig.worker = BlockWorker(
        rig.mover, remote=remote, slot_bytes=2 * rig.mover.host_block_bytes, slot_blocks=2
    )
    rig.serve_and_save("a", TOKENS, range(8))  # a0 a1 a2 in the store
    rig.serve_and_save("b", list(range(1000, 1042)), range(8, 19))  # 5 chunks evict a's from the pool
    x = RequestId("x")
    assert rig.lookup(x, TOKENS[:12]) == 8
    rig.sched.start_load(x, range(30, 33))
    (x_load,) = rig.step().ops  # fetches a0 back into the pool
    (k0,) = x_load.remote[0].keys
    assert (x_load.chain_from, x_load.chain) == (0, ((k0,),))
    # c: chunk 0 local, chunks 1 and 2 only remote -> the remote lookup is told of chunk 0
    c = RequestId("c")
    assert rig.lookup(c, TOKENS) == 24
    assert rig.index.asked[-1][1] == ((k0,),)
    rig.sched.start_load(c, range(20, 28))
    (c_load,) = rig.step().ops
    (k1,), (k2,) = (chunk.keys for chunk in c_load.remote)
    assert (c_load.chain_from, c_load.chain) == (0, ((k0,), (k1,), (k2,)))
    assert remote.last() == ("fetch", (k0, k1, k2))
    # a load wholly from the pool crosses no remote tier: it carries no chain
    d = RequestId("d")
    assert rig.lookup(d, TOKENS) == 24
    rig.sched.start_load(d, range(40, 46))
    (d_load,) = rig.step().ops
    assert (d_load.remote, d_load.chain_from, d_load.chain) == ((), 0, ())
    # c grows to 5 full chunks: its save carries chain positions 3 and 4 only
    grown = [*TOKENS, *range(130, 140)]
    assert rig.sched.save(c, range(20, 30), num_tokens=40, tokens=grown) == 2
    (c_save,) = rig.step().ops
    (k3,), (k4,) = (chunk.keys for chunk in c_save.remote)
    assert (c_save.chain_from, c_save.chain) == (3, ((k3,), (k4,)))
    assert remote.last() == ("publish", (k0, k1, k2, k3, k4))


def _save_op(op_id: int, rid: str, chunks: Sequence[tuple[ChunkKey, ChunkKey]], chain_from: int) -> BlockOp:
    """A save of ``chunks`` (rank 0 and rank 1 keys each) into slots 0.., carrying them as its chain."""
    return BlockOp(
        op_id,
        Direction.SAVE,
        range(2 * len(chunks)),
        range(2 * len(chunks)),
        rid,
        tuple(RemoteChunk(i, keys, 2 * i, 2) for i, keys in enumerate(chunks)),
        chain_from,
        tuple(chunks),
    )


def test_the_worker_keeps_its_ranks_chain_per_request(caplog: pytest.LogCaptureFixture) -> None:
    mover = InMemoryBlockMover(
        num_engine_blocks=8, num_host_blocks=8, layer_block_bytes=LAYOUT.block_bytes, num_layers=2
    )
    remote = Chains(InMemoryChunkStore(mover.host))
    worker = BlockWorker(mover, rank=1, remote=remote, slot_bytes=2 * mover.host_block_bytes, slot_blocks=2)
    a = [(ChunkKey(f"a{i}/r0"), ChunkKey(f"a{i}/r1")) for i in range(3)]
    other = (ChunkKey("o/r0"), ChunkKey("o/r1"))

    def run(*ops: BlockOp, ended: tuple[str, ...] = ()) -> None:
        plan = StepPlan(ops, ended)
        worker.execute(plan)
        reports = worker.wait(plan.op_ids(), 5.0)
        assert sorted(r.op_id for r in reports) == sorted(plan.op_ids())  # each reported once

    run(_save_op(1, "r", a[:1], 0))
    run(_save_op(2, "r", a[1:], 1), _save_op(3, "s", [other], 0))
    assert remote.chains == [
        ("publish", (a[0][1],)),
        ("publish", (a[0][1], a[1][1], a[2][1])),  # this rank's keys only
        ("publish", (other[1],)),  # another request, another chain
    ]
    # a delta from position 1 replaces what followed it
    run(_save_op(4, "r", [other], 1))
    assert remote.last() == ("publish", (a[0][1], other[1]))
    # a delta past the chain's end is not applied (the worker missed positions): warned, kept as it was
    with caplog.at_level(logging.WARNING):
        run(_save_op(5, "r", a[:1], 3))
    assert remote.last() == ("publish", (a[0][1], other[1]))
    assert "resumes at 3 past its 2 known keys" in caplog.text
    # the session ends: its chain is dropped, a later op of the same id starts a new one
    run(ended=("r",))
    run(attrs.evolve(_save_op(6, "r", a[2:], 0), chain=()))
    assert remote.last() == ("publish", ())


class DownStore(InMemoryChunkStore):
    """A store whose every put is refused, as a tier that is down (or has no shared memory) refuses."""

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        raise BackendUnavailable("the store is down")


def test_a_tier_that_fails_every_op_is_warned_about_once_not_per_op(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(slots=8)
    down = DownStore(rig.mover.host)
    rig.worker = BlockWorker(
        rig.mover, remote=StoreRemote(down), slot_bytes=2 * rig.mover.host_block_bytes, slot_blocks=2
    )
    with caplog.at_level(logging.WARNING, logger="kvcore.execution.worker"):
        for n in range(4):
            tokens = list(range(2000 + 100 * n, 2030 + 100 * n))
            rig.serve_and_save(f"r{n}", tokens, range(8 * n, 8 * n + 8))
    refusals = [r for r in caplog.records if "remote publish refused" in r.getMessage()]
    assert len(refusals) == 1
    assert rig.sched.stats().failed_save_chunks == 12  # every op still failed, and was counted
