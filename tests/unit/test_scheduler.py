"""The engine-agnostic scheduler with a worker over the in-memory mover: bytes round-trip, failures,
delayed frees, aborts and resets — asserted through the scheduler and the mover, not internals."""

from __future__ import annotations

import os
from collections.abc import Sequence

import attrs
import pytest

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import ConfigError, InvalidSpecError, UnsupportedConfiguration
from kvcore.execution.worker import BlockWorker
from kvcore.ids import ChunkKey, RequestId
from kvcore.keying.hashing import NO_EXTRA
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.step import OpReport, StepPlan
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore.testing.memory import InMemoryBlockMover, InMemoryChunkIndex

LAYOUT = KVLayout(
    kind=LayoutKind.VLLM_CPU, num_blocks=64, block_tokens=4, num_kv_heads=2, head_size=2, dtype_size=1
)
ENGINE = EngineSpec(model_id="tiny", kv_dtype="int8", num_layers=2, total_kv_heads=2, layout=LAYOUT)
TOKENS = list(range(100, 130))  # 30 tokens: 3 full chunks of 8, then 6 tokens


class Rig:
    def __init__(self, slots: int = 8, **extra: object) -> None:
        self.config: KVCoreConfig = load_config(
            {
                "backend": {"kind": "cpu", "size": 1 << 20},
                "chunk_tokens": 8,
                "partial_chunks": "drop",
                **extra,
            }
        )
        self.sched = CacheScheduler(self.config, ENGINE, slots)
        self.mover = InMemoryBlockMover(
            num_engine_blocks=64,
            num_host_blocks=slots * 2,
            layer_block_bytes=LAYOUT.block_bytes,
            num_layers=2,
        )
        self.worker = BlockWorker(self.mover)

    def step(self) -> None:
        plan = self.sched.take_plan()
        self.worker.execute(plan)
        self.sched.complete(self.worker.wait(plan.op_ids(), 5.0))

    def fill(self, blocks: Sequence[int]) -> dict[int, bytes]:
        data = {}
        for b in blocks:
            data[b] = os.urandom(self.mover.host_block_bytes // 2)
            self.mover.write_engine_block(b, data[b] * 2)
        return data

    def serve_and_save(self, rid: str, tokens: Sequence[int], blocks: Sequence[int]) -> dict[int, bytes]:
        assert self.sched.lookup(RequestId(rid), tokens=tokens) == 0
        data = self.fill(blocks)
        self.sched.save(RequestId(rid), blocks, num_tokens=len(tokens))
        self.step()
        assert self.sched.finish(RequestId(rid)) is False
        return data


def test_round_trip_is_byte_exact() -> None:
    rig = Rig()
    saved = rig.serve_and_save("a", TOKENS, range(8))
    # same prompt again: 24 tokens cached, capped below the prompt's 30 -> load 24 tokens (6 blocks)
    b = RequestId("b")
    assert rig.sched.lookup(b, tokens=TOKENS) == 24
    assert rig.sched.lookup(b, tokens=TOKENS) == 24  # asked again: cached answer
    assert not rig.sched.load_reads_remote(b)  # no remote tier: the host pool alone
    target = list(range(20, 28))
    untouched = rig.mover.read_engine_block(26)
    assert rig.sched.start_load(b, target) == 24
    rig.step()
    for i in range(6):
        assert rig.mover.read_engine_block(target[i]) == saved[i] * 2
    assert rig.mover.read_engine_block(26) == untouched  # beyond the load: never written
    assert rig.sched.take_load_errors() == {}
    assert rig.sched.stats().pool.pinned == 0


def test_load_starts_after_the_engines_own_hit() -> None:
    rig = Rig()
    saved = rig.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    # the engine holds 3 blocks (12 tokens) itself -> load blocks 3..5 only, starting mid-chunk
    assert rig.sched.lookup(b, tokens=TOKENS, local_tokens=12) == 12
    before = [rig.mover.read_engine_block(b_) for b_ in (40, 41, 42)]
    rig.sched.start_load(b, range(40, 48))
    rig.step()
    assert [rig.mover.read_engine_block(b_) for b_ in (40, 41, 42)] == before
    assert [rig.mover.read_engine_block(b_) for b_ in (43, 44, 45)] == [saved[i] * 2 for i in (3, 4, 5)]


def test_a_prompt_the_pool_holds_whole_loads_all_but_its_last_token() -> None:
    rig = Rig()
    saved = rig.serve_and_save("a", TOKENS[:24], range(6))  # 3 full chunks of 8 tokens
    b = RequestId("b")
    # the same 24 tokens again: tokens [4, 23) load (the engine holds the first block), the last block
    # (tokens 20..23) partly, copied whole; the engine computes token 23 itself
    assert rig.sched.lookup(b, tokens=TOKENS[:24], local_tokens=4) == 19
    held, beyond = rig.mover.read_engine_block(40), rig.mover.read_engine_block(46)
    assert rig.sched.start_load(b, range(40, 47)) == 19
    rig.step()
    assert [rig.mover.read_engine_block(40 + i) for i in range(1, 6)] == [saved[i] * 2 for i in range(1, 6)]
    assert (rig.mover.read_engine_block(40), rig.mover.read_engine_block(46)) == (held, beyond)
    assert rig.sched.extra_cached_tokens(b) == 19
    assert rig.sched.stats().hit_tokens == 19
    assert rig.sched.stats().async_loads == 0
    c = RequestId("c")
    assert rig.sched.lookup(c, tokens=TOKENS[:24]) == 23
    assert rig.sched.start_load(c, range(50, 56), is_async=True) == 23
    rig.step()
    assert rig.sched.stats().async_loads == 1


def test_failed_load_is_reported_for_recompute_and_unpins() -> None:
    rig = Rig()
    rig.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    rig.sched.lookup(b, tokens=TOKENS)
    rig.sched.start_load(b, range(20, 28))
    rig.mover.fail_next(1)
    rig.step()
    errors = rig.sched.take_load_errors()
    assert set(errors[b]) <= set(range(20, 26))
    assert errors[b]
    assert rig.sched.stats().pool.pinned == 0
    assert rig.sched.stats().failed_load_blocks == len(errors[b])


def test_asked_again_after_a_failed_load_the_lookup_stops_before_the_failure() -> None:
    rig = Rig()
    rig.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert rig.sched.lookup(b, tokens=TOKENS) == 24
    rig.sched.start_load(b, range(20, 28))
    rig.mover.fail_next(1)  # the first block of the load fails: chunk 0
    rig.step()
    assert rig.sched.take_load_errors()[b]
    assert rig.sched.lookup(b, tokens=TOKENS) == 0  # the engine gave the blocks back and asks again


def test_asked_again_after_chunks_left_the_pool_the_lookup_stops_before_them() -> None:
    rig = Rig(slots=8)
    rig.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert rig.sched.lookup(b, tokens=TOKENS) == 24
    chain = rig.sched.keyer.chain(NO_EXTRA, TOKENS, None, None)
    rig.sched.pool.remove([chain.keys[1]])  # chunk 1 leaves between the lookup and the load
    assert rig.sched.start_load(b, range(20, 28)) == 8
    assert rig.sched.lookup(b, tokens=TOKENS) == 8


def test_failed_save_drops_the_slot() -> None:
    rig = Rig()
    a = RequestId("a")
    rig.sched.lookup(a, tokens=TOKENS)
    rig.sched.save(a, range(8), num_tokens=30)
    rig.mover.fail_next(100)
    rig.step()
    assert rig.sched.lookup(RequestId("b"), tokens=TOKENS) == 0
    assert rig.sched.stats().pool.used == 0


def test_finish_with_save_in_flight_is_delayed() -> None:
    rig = Rig()
    a = RequestId("a")
    rig.sched.lookup(a, tokens=TOKENS)
    rig.sched.save(a, range(8), num_tokens=30)
    plan = rig.sched.take_plan()
    with rig.mover.stall():
        rig.worker.execute(plan)
        assert rig.sched.finish(a) is True
        assert rig.sched.take_finished() == ()
    rig.sched.complete(rig.worker.wait(plan.op_ids(), 5.0))
    assert rig.sched.take_finished() == (a,)
    assert rig.sched.lookup(RequestId("b"), tokens=TOKENS) == 24


def test_abort_before_scheduled_and_twice() -> None:
    rig = Rig()
    assert rig.sched.abort(RequestId("ghost")) is False
    a = RequestId("a")
    rig.sched.lookup(a, tokens=TOKENS)
    assert rig.sched.abort(a) is False
    assert rig.sched.abort(a) is False


def test_reset_with_save_in_flight_resurrects_nothing() -> None:
    rig = Rig()
    a = RequestId("a")
    rig.sched.lookup(a, tokens=TOKENS)
    rig.sched.save(a, range(8), num_tokens=30)
    plan = rig.sched.take_plan()
    with rig.mover.stall():
        rig.worker.execute(plan)
        rig.sched.reset()
    rig.sched.complete(rig.worker.wait(plan.op_ids(), 5.0))
    assert rig.sched.lookup(RequestId("b"), tokens=TOKENS) == 0
    assert rig.sched.stats().pool.used == 0


def test_decode_tokens_extend_the_keys() -> None:
    # turn 1: 30-token prompt + 10 answer tokens -> 5 full chunks saved; turn 2 reuses 32 tokens of it
    rig = Rig()
    a = RequestId("a")
    turn1 = [*TOKENS, *range(500, 510)]
    rig.sched.lookup(a, tokens=TOKENS)
    rig.fill(range(10))
    assert rig.sched.save(a, range(10), num_tokens=40, tokens=turn1) == 5
    rig.step()
    rig.sched.finish(a)
    turn2 = [*turn1, *range(900, 905)]
    assert rig.sched.lookup(RequestId("b"), tokens=turn2) == 40


def test_full_pool_evicts_least_recent() -> None:
    rig = Rig(slots=3)
    rig.serve_and_save("a", TOKENS, range(8))  # 3 chunks: pool full
    other = list(range(1000, 1030))
    rig.serve_and_save("b", other, range(8, 16))  # evicts a's chunks
    assert rig.sched.stats().pool.used == 3
    assert rig.sched.stats().pool.evictions == 3
    assert rig.sched.lookup(RequestId("c"), tokens=TOKENS) == 0


def test_chunk_must_be_whole_blocks() -> None:
    config = load_config({"backend": {"kind": "cpu", "size": 1 << 20}, "chunk_tokens": 6})
    with pytest.raises(ConfigError, match="chunk_tokens"):
        CacheScheduler(config, ENGINE, 4)


def test_start_load_with_too_few_blocks() -> None:
    rig = Rig()
    rig.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    rig.sched.lookup(b, tokens=TOKENS)
    with pytest.raises(InvalidSpecError, match="blocks"):
        rig.sched.start_load(b, [1, 2])


def test_a_chunk_that_failed_to_load_is_not_served_again() -> None:
    # load of 3 chunks, first block fails -> chunk 0 dropped from the pool; the prefix is gone
    rig = Rig()
    rig.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    rig.sched.lookup(b, tokens=TOKENS)
    rig.sched.start_load(b, range(20, 28))
    rig.mover.fail_next(1)
    rig.step()
    assert rig.sched.extra_cached_tokens(b) == 0  # the first block failed: nothing after it counts
    assert rig.sched.lookup(RequestId("c"), tokens=TOKENS) == 0
    assert rig.sched.stats().pool.pinned == 0


def test_stats_count_requests_and_ops() -> None:
    rig = Rig()
    a = RequestId("a")
    rig.sched.lookup(a, tokens=TOKENS)
    rig.sched.save(a, range(8), num_tokens=30)
    assert rig.sched.stats().ops_in_flight == 1
    assert rig.sched.stats().requests == 1
    rig.step()
    rig.sched.finish(a)
    assert rig.sched.stats().requests == 0
    assert rig.sched.stats().ops_in_flight == 0


def test_save_after_two_sightings() -> None:
    # N = 2: the first request's chunks are not saved; the second asks again and saves them
    rig = Rig(save_after_sightings=2)
    a, b = RequestId("a"), RequestId("b")
    rig.sched.lookup(a, tokens=TOKENS)
    assert rig.sched.save(a, range(8), num_tokens=30) == 0
    rig.sched.finish(a)
    assert rig.sched.lookup(b, tokens=TOKENS) == 0
    assert rig.sched.save(b, range(8), num_tokens=30) == 3
    rig.step()
    assert rig.sched.lookup(RequestId("c"), tokens=TOKENS) == 24


def test_chunks_gone_before_the_load_are_lost_blocks() -> None:
    # pool of 3: lookup sees a's 3 chunks, then b's saves evict them before a second request loads
    rig = Rig(slots=3)
    rig.serve_and_save("a", TOKENS, range(8))
    c = RequestId("c")
    assert rig.sched.lookup(c, tokens=TOKENS) == 24
    rig.serve_and_save("b", list(range(1000, 1030)), range(8, 16))
    assert rig.sched.start_load(c, range(20, 28)) == 0
    assert rig.sched.take_lost_blocks() == tuple(range(20, 26))
    assert rig.sched.take_load_errors() == {}  # taken once, by either form
    assert rig.sched.extra_cached_tokens(c) == 0


def test_a_sliding_window_load_skips_the_blocks_the_engine_no_longer_holds() -> None:
    # the engine holds only the last two blocks of the hit (a sliding window): the load writes exactly
    # those, with the bytes saved, and the hit still counts every token of it
    rig = Rig()
    saved = rig.serve_and_save("a", TOKENS, range(8))
    assert rig.sched.lookup(RequestId("b"), tokens=TOKENS) == 24
    window: list[int | None] = [None, None, None, None, 40, 41]
    assert rig.sched.start_load(RequestId("b"), window) == 24
    (op,) = rig.sched.take_plan().ops
    assert op.engine_blocks == (40, 41)
    rig.worker.execute(StepPlan((op,)))
    rig.sched.complete(rig.worker.wait([op.op_id], 5.0))
    assert [rig.mover.read_engine_block(b)[: len(saved[4])] for b in (40, 41)] == [saved[4], saved[5]]
    assert rig.sched.extra_cached_tokens(RequestId("b")) == 24


def test_a_failed_block_after_skipped_ones_counts_from_where_it_is() -> None:
    # the window's first held block loads, its second fails: the hit served is the skipped blocks and
    # the one that loaded (what the fuzzer's --window mode found counted from the skipped ones' start)
    rig = Rig()
    rig.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert rig.sched.lookup(b, tokens=TOKENS) == 24
    assert rig.sched.start_load(b, [None, None, None, None, 40, 41]) == 24
    (op,) = rig.sched.take_plan().ops
    rig.sched.complete([OpReport(op.op_id, 0, (1,))])
    assert rig.sched.take_load_errors() == {b: (41,)}
    assert rig.sched.extra_cached_tokens(b) == 20


def test_a_hole_after_a_held_block_of_a_load_is_refused() -> None:
    rig = Rig()
    rig.serve_and_save("a", TOKENS, range(8))
    assert rig.sched.lookup(RequestId("b"), tokens=TOKENS) == 24
    with pytest.raises(InvalidSpecError, match=r"block_ids: request b: .*1 of those missing after"):
        rig.sched.start_load(RequestId("b"), [None, 30, None, 32, 33, 34])


def test_cap_load_lowers_the_decided_load_never_raises_it() -> None:
    rig = Rig()
    rig.serve_and_save("a", TOKENS, range(8))
    assert rig.sched.lookup(RequestId("b"), tokens=TOKENS) == 24
    assert rig.sched.cap_load(RequestId("b"), 100) == 24
    assert rig.sched.cap_load(RequestId("b"), 8) == 8
    assert rig.sched.start_load(RequestId("b"), range(20, 26)) == 8
    (op,) = rig.sched.take_plan().ops
    assert op.engine_blocks == (20, 21)
    assert rig.sched.lookup(RequestId("c"), tokens=TOKENS) == 24
    assert rig.sched.cap_load(RequestId("c"), 0) == 0
    assert rig.sched.start_load(RequestId("c"), range(30, 36)) == 0
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(InvalidSpecError, match=r"num_tokens: got"):
            rig.sched.cap_load(RequestId("c"), bad)  # type: ignore[arg-type]  # wrong on purpose


def _pool_keys(rig: Rig) -> list[ChunkKey]:
    """The pool's keys of ``TOKENS``' three chunks."""
    return list(rig.sched.keyer.chain(NO_EXTRA, TOKENS, None, None).keys)


@pytest.mark.parametrize(
    ("dropped", "hit"), [((0, 1), 24), ((1,), 24), ((2,), 16), ((1, 2), 8), ((0, 1, 2), 0)]
)
def test_a_sliding_window_lookup_asks_only_for_the_hits_last_window(
    dropped: tuple[int, ...], hit: int
) -> None:
    # a window of 8 tokens: a hit of 24 needs chunk 2 alone, one of 16 chunk 1 alone (tokens 8 to 15);
    # chunks before the window may be gone. A full attention engine needs them all
    rig = Rig()
    rig.sched = CacheScheduler(rig.config, attrs.evolve(ENGINE, window_tokens=8), 8)
    rig.serve_and_save("a", TOKENS, range(8))
    keys = _pool_keys(rig)
    assert rig.sched.pool.remove([keys[i] for i in dropped]) == len(dropped)
    assert rig.sched.lookup(RequestId("b"), tokens=TOKENS) == hit
    full = Rig()
    full.serve_and_save("a", TOKENS, range(8))
    full.sched.pool.remove([keys[i] for i in dropped])
    assert full.sched.lookup(RequestId("b"), tokens=TOKENS) == 8 * min(dropped)


def test_a_capped_sliding_window_load_stops_where_its_window_is_held() -> None:
    rig = Rig()
    rig.sched = CacheScheduler(rig.config, attrs.evolve(ENGINE, window_tokens=8), 8)
    rig.serve_and_save("a", TOKENS, range(8))
    keys = _pool_keys(rig)
    rig.sched.pool.remove([keys[1]])
    assert rig.sched.lookup(RequestId("b"), tokens=TOKENS) == 24
    # asked to serve 20 tokens, it needs chunks 1 and 2 (tokens 12 to 19): chunk 1 is gone, so 8 it is
    assert rig.sched.cap_load(RequestId("b"), 20) == 8


STATE_LAYOUT = KVLayout(
    kind=LayoutKind.STATE,
    num_blocks=64,
    block_tokens=8,
    num_kv_heads=1,
    head_size=8,
    dtype_size=1,
    page_bytes=16,
)
STATE_ENGINE = EngineSpec(
    model_id="ssm", kv_dtype="int8", num_layers=2, total_kv_heads=1, layout=STATE_LAYOUT, window_tokens=8
)


def test_a_state_is_saved_where_the_engine_holds_one_and_a_hit_stops_at_a_chunk_end() -> None:
    # a recurrent model's engine holds a state in the blocks where its computation stopped (here after
    # 16 tokens), the null block elsewhere: only that chunk is saved, and a hit is a chunk end whose
    # state is held, below the prompt's last token (a state after a token inside a chunk is not kept)
    rig = Rig()
    rig.sched = CacheScheduler(rig.config, STATE_ENGINE, 8)
    a = RequestId("a")
    assert rig.sched.lookup(a, tokens=TOKENS) == 0
    saved = rig.fill([5])
    assert rig.sched.save(a, [None, 5, None, 7], num_tokens=len(TOKENS)) == 1
    rig.step()
    rig.sched.finish(a)
    for rid, length, hit in (("b", 30, 16), ("c", 17, 16), ("d", 16, 0), ("e", 24, 16)):
        assert rig.sched.lookup(RequestId(rid), tokens=TOKENS[:length]) == hit, rid
    # the load writes the state into the one block the engine holds for it, at the hit's end
    b = RequestId("b")
    assert rig.sched.start_load(b, [None, 40]) == 16
    (op,) = rig.sched.take_plan().ops
    assert op.engine_blocks == (40,)
    rig.worker.execute(StepPlan((op,)))
    rig.sched.complete(rig.worker.wait([op.op_id], 5.0))
    assert rig.mover.read_engine_block(40)[: len(saved[5])] == saved[5]
    # capped inside a chunk by another group, a state hit falls to the chunk end below, here none held
    f = RequestId("f")
    assert rig.sched.lookup(f, tokens=TOKENS) == 16
    assert rig.sched.cap_load(f, 12) == 0


def test_a_state_engine_takes_chunks_of_one_block_and_no_remote_tier() -> None:
    rig = Rig(chunk_tokens=16)
    with pytest.raises(ConfigError, match=r"chunk_tokens.*block size 8: a recurrent state is kept per block"):
        CacheScheduler(rig.config, STATE_ENGINE, 8)
    with pytest.raises(UnsupportedConfiguration, match="served from the local pool alone"):
        CacheScheduler(Rig().config, STATE_ENGINE, 8, remote=InMemoryChunkIndex())
    with pytest.raises(InvalidSpecError, match=r"window_tokens: got 16, expected the block size 8"):
        attrs.evolve(STATE_ENGINE, window_tokens=16)
