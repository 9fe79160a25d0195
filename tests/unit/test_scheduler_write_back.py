"""Write-back through the scheduler and a worker (in-memory mover and store behind a cascade of one tier
written back): dirty chunks are never evicted and reach the tier only under pressure, least recently used
first; a failed write-back keeps the chunk clean in the pool; a reset or a suspect load never lets a
chunk be written back that should not be; nothing stays pinned."""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvcore.execution.cascade_remote import CascadeRemote
from kvcore.execution.remote import StoreRemote
from kvcore.ids import ChunkKey, RequestId
from kvcore.keying.hashing import NO_EXTRA
from kvcore.model.step import WRITE_BACK_SESSION, StepPlan
from kvcore.pool.block_pool import PoolEventKind
from tests.unit import test_scheduler_remote as remote
from tests.unit.test_scheduler_remote import answer

SLOTS = 8  # write-back keeps two of them free or clean


def prompt(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(17)]  # two chunks of 8 tokens and a token


class Rig(remote.Rig):
    """The remote tests' rig with eight slots, its store a tier written back (a cascade of one)."""

    def __init__(self) -> None:
        super().__init__(
            SLOTS,
            remote.CONFIG,
            lambda store: CascadeRemote([StoreRemote(store)], [1], [True]),
            write_back=True,
        )
        self.blocks = 0

    def queue_save(self, rid: str, tokens: Sequence[int]) -> None:
        """The request's KV computed in its next four engine blocks, its two chunks' saves queued."""
        assert answer(self.sched, rid, tokens) == 0
        blocks = range(self.blocks, self.blocks + 4)
        self.blocks += 4
        for b in blocks:
            self.mover.write_engine_block(b, os.urandom(self.mover.host_block_bytes))
        assert self.sched.save(RequestId(rid), blocks, num_tokens=len(tokens)) == 2

    def save(self, rid: str, tokens: Sequence[int]) -> StepPlan:
        self.queue_save(rid, tokens)
        plan = self.step()
        self.sched.finish(RequestId(rid))
        return plan


def shard_keys(rig: Rig, tokens: Sequence[int]) -> list[ChunkKey]:
    """Rank 0's keys of the prompt's chunks in the tier."""
    chain = rig.sched.keyer.chain(NO_EXTRA, tokens, None, None)
    return [keys[0] for keys in chain.rank_keys]


def test_dirty_chunks_reach_the_tier_only_under_pressure_least_recently_used_first() -> None:
    rig = Rig()
    for i in range(3):
        rig.save(f"r{i}", prompt(i))
    assert len(rig.store) == 0  # 6 of 8 slots dirty: a quarter is still free
    plan = rig.save("r3", prompt(3))  # 8 dirty: its step writes the two least recently used back
    assert [len(op.remote) for op in plan.ops if op.write_back] == [2]
    stats = rig.sched.stats()
    assert (stats.written_back_chunks, stats.pool.dirty, stats.pool.evictable, stats.pool.pinned) == (
        2,
        6,
        2,
        0,
    )
    assert rig.store.exists(shard_keys(rig, prompt(0))) == (True, True)  # r0's, the oldest
    (written,) = [e for e in rig.sched.take_events() if e.tier]
    assert (written.kind, written.tier, len(written.keys)) == (PoolEventKind.STORED, 1, 2)
    assert answer(rig.sched, "again", prompt(0)) == 16  # still in the pool, clean now
    assert not any(op.write_back for op in rig.step().ops)  # two clean slots: room enough


def test_closing_the_worker_writes_back_what_is_still_dirty() -> None:
    rig = Rig()
    for i in range(3):
        rig.save(f"r{i}", prompt(i))
    rig.save("r3", prompt(3))  # r0's chunks written back at this step; the others still dirty
    assert len(rig.store) == 2
    rig.worker.close()
    assert len(rig.store) == 8  # every chunk saved, once
    for i in range(4):
        assert rig.store.exists(shard_keys(rig, prompt(i))) == (True, True)


def test_a_slot_written_again_is_never_written_back_under_its_old_chunks_key() -> None:
    rig = Rig()
    rig.save("r0", prompt(0))  # dirty in the worker's slots
    old = shard_keys(rig, prompt(0))
    rig.sched.reset()  # the scheduler drops r0's dirty chunks and frees their slots; the worker is not told
    fetched = shard_keys(rig, prompt(9))  # chunks another engine left in the tier
    for key in fetched:
        rig.store.poke(key, os.urandom(2 * rig.mover.host_block_bytes))
    assert answer(rig.sched, "c", prompt(9)) == 16
    rig.sched.start_load(RequestId("c"), range(40, 44))
    plan = rig.step()  # fetched into the freed slots, r0's
    (load,) = plan.ops
    assert {chunk.slot for chunk in load.remote} == {0, 1}
    rig.worker.close()
    assert rig.store.exists(old) == (False, False)  # those slots hold prompt 9's KV: never written as r0's


def test_a_failed_write_back_leaves_the_chunk_clean_in_the_pool() -> None:
    rig = Rig()
    for i in range(3):
        rig.save(f"r{i}", prompt(i))
    rig.store.fail_next(2)
    rig.save("r3", prompt(3))
    stats = rig.sched.stats()
    assert (stats.written_back_chunks, stats.failed_write_back_chunks) == (2, 2)
    assert (stats.pool.dirty, stats.pool.evictable, stats.pool.pinned) == (6, 2, 0)
    assert len(rig.store) == 0
    assert not [e for e in rig.sched.take_events() if e.tier]  # stored nowhere: no event


def test_a_reset_drops_dirty_chunks_and_a_write_back_in_flight_frees_its_slots() -> None:
    rig = Rig()
    for i in range(3):
        rig.save(f"r{i}", prompt(i))
    rig.queue_save("r3", prompt(3))
    plan = rig.sched.take_plan()
    assert [op.request_id for op in plan.ops if op.write_back] == [WRITE_BACK_SESSION]
    rig.worker.execute(plan)
    rig.sched.reset()  # before the reports: every dirty chunk is dropped, the write-back's at its end
    rig.sched.complete(rig.worker.wait(plan.op_ids(), 5.0))
    rig.sched.finish(RequestId("r3"))
    usage = rig.sched.stats().pool
    assert (usage.used, usage.ready, usage.dirty, usage.pinned) == (0, 0, 0, 0)
    assert not rig.step().ops  # nothing dirty is left to write back


def test_a_chunk_whose_load_failed_is_never_written_back() -> None:
    rig = Rig()
    rig.save("r0", prompt(0))
    for reader, blocks in (("a", range(40, 44)), ("b", range(44, 48))):  # two loads of r0's chunks
        assert answer(rig.sched, reader, prompt(0)) == 16
        rig.sched.start_load(RequestId(reader), blocks)
    rig.mover.fail_next(4)  # every block of the first fails: the chunks are suspect
    rig.step()
    assert rig.sched.take_load_errors() == {RequestId("a"): (40, 41, 42, 43)}
    for i in range(1, 5):
        rig.save(f"r{i}", prompt(i))
    stats = rig.sched.stats()
    assert stats.written_back_chunks == len(rig.store) > 0
    assert stats.pool.pinned == 0
    assert rig.store.exists(shard_keys(rig, prompt(0))) == (False, False)  # suspect: in no tier
