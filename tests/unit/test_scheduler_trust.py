"""Paths that served wrong KV or leaked, each reproduced through the engine-agnostic API: preemption with
copies in flight, resets with a remote tier, duplicate or non-integer block ids, salts beside block
hashes, partial chunks that fill up, stale extra-cached counts, refused calls that leaked pins or state.

The engine here is the in-memory mover (a reference for the ``BlockMover`` port, with stalls and injected
failures); ``tests/backends/test_trust_cpu.py`` runs the fencing cases on the real CPU mover."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import InvalidSpecError
from kvcore.execution.remote import StoreRemote
from kvcore.execution.worker import BlockWorker
from kvcore.ids import RequestId
from kvcore.keying.hashing import ExtraKeys, MMSpan
from kvcore.model.step import StepPlan
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore.testing.memory import InMemoryBlockMover, InMemoryChunkStore, InMemoryStoreIndex
from tests.unit.test_scheduler import ENGINE, LAYOUT, TOKENS
from tests.unit.test_scheduler_remote import answer

CHUNK = 8  # tokens; 2 blocks of 4


class Engine:
    """An engine on the in-memory mover, optionally with a remote store behind the pool."""

    def __init__(self, slots: int = 8, remote: bool = False, **extra: object) -> None:
        self.config: KVCoreConfig = load_config(
            {
                "backend": {"kind": "cpu", "size": 1 << 20},
                "chunk_tokens": CHUNK,
                "partial_chunks": "drop",
                **extra,
            }
        )
        self.mover = InMemoryBlockMover(
            num_engine_blocks=64,
            num_host_blocks=slots * 2,
            layer_block_bytes=LAYOUT.block_bytes,
            num_layers=2,
        )
        self.store = InMemoryChunkStore(self.mover.host) if remote else None
        self.index = InMemoryStoreIndex(self.store.exists) if self.store is not None else None
        self.sched = CacheScheduler(self.config, ENGINE, slots, remote=self.index)
        tier = StoreRemote(self.store) if self.store is not None else None
        self.worker = BlockWorker(
            self.mover, remote=tier, slot_bytes=2 * self.mover.host_block_bytes, slot_blocks=2
        )

    def execute(self) -> StepPlan:
        """Start the step's plan without waiting for it."""
        plan = self.sched.take_plan()
        self.worker.execute(plan)
        return plan

    def settle(self, plan: StepPlan) -> None:
        self.sched.complete(self.worker.wait(plan.op_ids(), 5.0))

    def step(self) -> StepPlan:
        plan = self.execute()
        self.settle(plan)
        return plan

    def fill(self, blocks: Sequence[int], tag: str) -> dict[int, bytes]:
        data = {}
        for b in blocks:
            data[b] = hashlib.sha256(f"{tag}/{b}".encode()).digest() * (self.mover.host_block_bytes // 32)
            self.mover.write_engine_block(b, data[b])
        return data

    def serve_and_save(self, rid: str, tokens: Sequence[int], blocks: Sequence[int]) -> dict[int, bytes]:
        assert answer(self.sched, rid, tokens) == 0
        data = self.fill(blocks, rid)
        self.sched.save(RequestId(rid), blocks, num_tokens=len(tokens))
        self.step()
        assert self.sched.finish(RequestId(rid)) is False
        return data

    def quiet(self) -> None:
        """Nothing left behind: no tracker, no op, no pin, no store in flight."""
        stats = self.sched.stats()
        assert (stats.requests, stats.ops_in_flight, stats.pool.pinned, stats.pool.storing) == (0, 0, 0, 0)


# -- preemption: the plan carries what to fence ----------------------------------------------------------


def test_a_save_still_queued_when_its_request_is_preempted_keeps_nothing_the_engine_wrote_since() -> None:
    eng = Engine()
    a = RequestId("a")
    assert eng.sched.lookup(a, tokens=TOKENS) == 0
    eng.fill(range(8), "a")
    eng.sched.save(a, range(8), num_tokens=len(TOKENS))
    with eng.mover.stall():  # the copy is late
        saving = eng.execute()
        eng.sched.preempt(a)  # the engine frees a's blocks ...
        plan = eng.execute()  # ... and runs the next plan before reusing them
        assert plan.fenced == saving.op_ids()
        eng.fill(range(8), "someone-else")  # the blocks now hold another request's KV
    eng.settle(saving)
    # nothing of what the late copy read was kept: the same prompt misses instead of loading foreign KV
    assert eng.sched.lookup(RequestId("b"), tokens=TOKENS) == 0
    eng.sched.finish(a)
    eng.sched.finish(RequestId("b"))
    eng.quiet()


def test_a_save_submitted_and_preempted_in_the_same_step_moves_nothing() -> None:
    eng = Engine()
    a = RequestId("a")
    assert eng.sched.lookup(a, tokens=TOKENS) == 0
    eng.fill(range(8), "a")
    eng.sched.save(a, range(8), num_tokens=len(TOKENS))
    eng.sched.preempt(a)  # before the plan with the save went out
    plan = eng.execute()
    assert plan.fenced == plan.op_ids()
    eng.settle(plan)
    assert eng.sched.stats().saved_blocks == 0
    assert eng.sched.lookup(RequestId("b"), tokens=TOKENS) == 0


def test_a_preempted_request_saves_again_after_it_resumes() -> None:
    eng = Engine()
    a = RequestId("a")
    assert eng.sched.lookup(a, tokens=TOKENS) == 0
    eng.fill(range(8), "a")
    eng.sched.save(a, range(8), num_tokens=len(TOKENS))
    eng.sched.preempt(a)
    eng.step()  # the fenced save stored nothing
    assert eng.sched.lookup(a, tokens=TOKENS) == 0  # resumed, looked up afresh
    saved = eng.fill(range(20, 28), "a-again")
    assert eng.sched.save(a, range(20, 28), num_tokens=len(TOKENS)) == 3
    eng.step()
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 24
    eng.sched.start_load(b, range(40, 48))
    eng.step()
    assert [eng.mover.read_engine_block(40 + i) for i in range(6)] == [saved[20 + i] for i in range(6)]


def test_a_load_still_fetching_when_its_request_is_preempted_writes_nothing_more() -> None:
    eng = Engine(slots=3, remote=True)
    assert eng.store is not None
    eng.serve_and_save("a", TOKENS, range(8))  # in the pool and the store
    eng.serve_and_save("x", list(range(500, 530)), range(8, 16))  # evicts a's chunks from the pool
    b = RequestId("b")
    assert answer(eng.sched, b, TOKENS) == 24  # from the store only
    eng.sched.start_load(b, range(20, 28))
    mine = eng.fill(range(20, 28), "now-someone-else")
    with eng.store.stall():  # the fetch is late
        loading = eng.execute()
        eng.sched.preempt(b)
        plan = eng.execute()
        assert plan.fenced == loading.op_ids()
    eng.settle(loading)
    assert [eng.mover.read_engine_block(b) for b in range(20, 28)] == [mine[b] for b in range(20, 28)]
    assert eng.sched.take_load_errors() == {}  # blocks b no longer owns are not its errors
    assert eng.sched.extra_cached_tokens(b) == 0


def test_a_fenced_load_leaves_the_pools_chunks_servable() -> None:
    eng = Engine()
    saved = eng.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 24
    eng.sched.start_load(b, range(20, 28))
    eng.sched.preempt(b)
    eng.step()
    c = RequestId("c")
    assert eng.sched.lookup(c, tokens=TOKENS) == 24  # fencing is not corruption: the chunks stay
    eng.sched.start_load(c, range(40, 48))
    eng.step()
    assert [eng.mover.read_engine_block(40 + i) for i in range(6)] == [saved[i] for i in range(6)]


# -- reset with a remote tier -----------------------------------------------------------------------------


def test_a_request_looked_up_before_a_reset_never_hits_pre_reset_chunks() -> None:
    eng = Engine(slots=3, remote=True)
    eng.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert answer(eng.sched, b, TOKENS) == 24  # cached answer and keys of the old epoch
    eng.sched.reset()
    assert answer(eng.sched, b, TOKENS) == 0  # keyed again under the new epoch
    assert eng.sched.start_load(b, range(20, 28)) == 0
    assert answer(eng.sched, RequestId("c"), TOKENS) == 0


def test_a_remote_lookup_in_flight_at_a_reset_is_dropped() -> None:
    eng = Engine(slots=3, remote=True)
    assert eng.store is not None
    eng.serve_and_save("a", TOKENS, range(8))
    eng.serve_and_save("x", list(range(500, 530)), range(8, 16))
    b = RequestId("b")
    with eng.store.stall():
        first = eng.sched.lookup(b, tokens=TOKENS)
    eng.sched.reset()
    assert first in (None, 24)
    assert answer(eng.sched, b, TOKENS) == 0


def test_a_load_submitted_before_a_reset_is_reported_failed() -> None:
    eng = Engine()
    eng.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 24
    eng.sched.start_load(b, range(20, 28))
    with eng.mover.stall():
        loading = eng.execute()
        eng.sched.reset()
    eng.settle(loading)
    assert eng.sched.take_load_errors() == {b: tuple(range(20, 26))}  # recompute them
    assert eng.sched.extra_cached_tokens(b) == 0


# -- block ids ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("blocks", "match"),
    [
        ([3, 3, 3, 3, 3, 3, 3, 3], r"block_ids\[1\]: block 3 appears twice"),
        ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], r"block_ids: got 0\.0"),
        (["0", "1", "2", "3", "4", "5", "6", "7"], r"block_ids: got '0'"),
        ([True, False], r"block_ids: got True"),
        ([0, 1, 2, 64], r"block_ids\[3\]: got block 64, expected a block id in \[0, 64\)"),
        ([-1, 1], r"block_ids\[0\]: got block -1"),
        ("01234567", r"block_ids: got '01234567'"),
    ],
)
def test_bad_block_ids_are_refused_by_save_and_start_load_and_change_nothing(
    blocks: object, match: str
) -> None:
    eng = Engine()
    eng.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 24
    with pytest.raises(InvalidSpecError, match=match):
        eng.sched.save(b, blocks, num_tokens=len(TOKENS))  # type: ignore[arg-type]  # hostile input
    with pytest.raises(InvalidSpecError, match=match):
        eng.sched.start_load(b, blocks)  # type: ignore[arg-type]  # hostile input
    assert eng.sched.stats().ops_in_flight == 0
    assert eng.sched.start_load(b, range(20, 28)) == 24  # the refused calls consumed nothing


def test_a_chunk_with_a_hole_in_the_block_table_is_not_saved() -> None:
    eng = Engine()
    a = RequestId("a")
    assert eng.sched.lookup(a, tokens=TOKENS) == 0
    eng.fill(range(8), "a")
    assert eng.sched.save(a, [None, 1, 2, 3, 4, 5, 6, 7], num_tokens=len(TOKENS)) == 2
    (op,) = eng.step().ops
    assert op.engine_blocks == (2, 3, 4, 5)
    b = RequestId("b")
    eng.serve_and_save("c", list(range(200, 230)), range(30, 38))
    assert eng.sched.lookup(b, tokens=list(range(200, 230))) == 24
    with pytest.raises(InvalidSpecError, match="missing"):  # a load never writes a hole
        eng.sched.start_load(b, [20, None, 22, 23, 24, 25, 26, 27])


# -- salts ------------------------------------------------------------------------------------------------


def _block_hashes(tokens: Sequence[int]) -> list[bytes]:
    """An engine's own chained block hashes (4-token blocks), salt-blind."""
    out, parent = [], b"root"
    for i in range(len(tokens) // 4):
        parent = hashlib.sha256(parent + bytes(str(tokens[4 * i : 4 * i + 4]), "ascii")).digest()
        out.append(parent)
    return out


def test_a_salt_beside_block_hashes_is_folded_in_never_dropped() -> None:
    eng = Engine()
    hashes = _block_hashes(TOKENS)
    a = RequestId("a")

    def lookup(rid: str, extra: ExtraKeys) -> int | None:
        return eng.sched.lookup(
            RequestId(rid), block_hashes=hashes, hash_block_tokens=4, num_tokens=len(TOKENS), extra=extra
        )

    assert lookup("a", ExtraKeys(cache_salt="tenant-a")) == 0
    eng.fill(range(8), "a")
    eng.sched.save(a, range(8), num_tokens=len(TOKENS))
    eng.step()
    assert lookup("b", ExtraKeys(cache_salt="tenant-b")) == 0
    assert lookup("c", ExtraKeys()) == 0
    assert lookup("d", ExtraKeys(lora_id="tenant-a")) == 0
    assert lookup("e", ExtraKeys(cache_salt="tenant-a")) == 24


@pytest.mark.parametrize("salt", [0, 1, 0.5, b"x", ["x"]])
def test_a_salt_that_is_not_a_string_is_refused(salt: object) -> None:
    with pytest.raises(InvalidSpecError, match="cache_salt"):
        ExtraKeys(cache_salt=salt)


_extras = st.builds(
    ExtraKeys,
    cache_salt=st.one_of(st.none(), st.text(min_size=1, max_size=4)),
    lora_id=st.one_of(st.none(), st.sampled_from(["l1", "l2"])),
    mm=st.lists(
        st.builds(
            MMSpan,
            mm_hash=st.sampled_from(["img1", "img2"]),
            offset=st.integers(0, 20),
            length=st.integers(1, 6),
        ),
        max_size=2,
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 9), min_size=8, max_size=24),
    first=_extras,
    second=_extras,
    by_hashes=st.booleans(),
)
def test_different_extra_keys_never_share_a_chunk(
    tokens: list[int], first: ExtraKeys, second: ExtraKeys, by_hashes: bool
) -> None:
    """Through either entry point (tokens, or the engine's block hashes), two requests whose extra keys
    differ in anything that covers a chunk's tokens never share that chunk's key."""
    sched = CacheScheduler(
        load_config({"backend": {"kind": "cpu", "size": 1 << 20}, "chunk_tokens": CHUNK}), ENGINE, 8
    )

    def keys(rid: str, extra: ExtraKeys) -> tuple[str, ...]:
        if by_hashes:
            return sched.keyer.chain(extra, None, _block_hashes(tokens), 4).keys
        return sched.keyer.chain(extra, tokens, None, None).keys

    one, two = keys("one", first), keys("two", second)  # the keys a lookup of each would use
    for i, (k1, k2) in enumerate(zip(one, two, strict=True)):
        end = (i + 1) * CHUNK

        def covering(extra: ExtraKeys, end: int = end) -> tuple[object, ...]:
            return (extra.cache_salt, extra.lora_id, tuple(s for s in extra.mm if s.offset < end))

        if covering(first) != covering(second):
            assert k1 != k2, f"chunk {i} shared by {first} and {second}"


def test_a_chunk_gone_before_its_load_is_not_saved_from_the_blocks_it_never_loaded() -> None:
    # the chunk left the pool between lookup and load; the same step's save must not store what the
    # blocks held before (nor what the engine computes over them in that step): only once recomputed
    eng = Engine()
    saved = eng.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 24
    chunk1 = eng.sched.keyer.chain(ExtraKeys(), TOKENS, None, None).keys[1]
    assert eng.sched.pool.remove([chunk1]) == 1
    eng.fill(range(20, 28), "stale")
    assert eng.sched.start_load(b, range(20, 28)) == 8
    assert eng.sched.save(b, range(20, 28), num_tokens=len(TOKENS)) == 0  # chunk 0 is held already
    eng.step()
    assert eng.sched.take_load_errors() == {b: (22, 23, 24, 25)}
    recomputed = eng.fill(range(22, 28), "b")  # the engine recomputes from the first lost block
    assert eng.sched.save(b, range(20, 28), num_tokens=len(TOKENS)) == 1  # chunk 1 (2 is held)
    eng.step()
    eng.sched.finish(b)
    c = RequestId("c")
    assert eng.sched.lookup(c, tokens=TOKENS) == 24
    eng.sched.start_load(c, range(40, 48))
    eng.step()
    got = [eng.mover.read_engine_block(40 + i) for i in range(6)]
    assert got == [saved[0], saved[1], recomputed[22], recomputed[23], saved[4], saved[5]]


# -- partial chunks, extra cached tokens ----------------------------------------------------------------


def test_a_partial_chunk_filled_by_decode_is_saved_under_its_full_key() -> None:
    eng = Engine(partial_chunks="keep")
    a = RequestId("a")
    assert eng.sched.lookup(a, tokens=TOKENS) == 0  # 3 full chunks and a partial one of 6 tokens
    grown = [*TOKENS, 7, 8]  # two decode tokens fill the fourth chunk
    eng.fill(range(8), "a")
    # the four full chunks, and the prompt's tail (its last whole block, in the fourth chunk)
    assert eng.sched.save(a, range(8), num_tokens=len(grown), tokens=grown) == 5
    eng.step()
    eng.sched.finish(a)
    turn2 = [*grown, 9, 9, 9]
    assert eng.sched.lookup(RequestId("b"), tokens=turn2) == 32  # the next turn hits all four


def test_extra_cached_tokens_count_the_load_after_a_preemption_afresh() -> None:
    eng = Engine()
    eng.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 24
    eng.sched.start_load(b, range(20, 28))
    eng.mover.fail_next(1)  # the first block fails: its chunk is suspect and dropped
    eng.step()
    assert eng.sched.extra_cached_tokens(b) == 0
    eng.sched.preempt(b)
    eng.serve_and_save("a2", TOKENS, range(8))  # saved again
    assert eng.sched.lookup(b, tokens=TOKENS) == 24
    eng.sched.start_load(b, range(30, 38))
    eng.step()
    assert eng.sched.take_load_errors() == {}
    assert eng.sched.extra_cached_tokens(b) == 24


# -- refused calls leak nothing ---------------------------------------------------------------------------


def test_start_load_after_an_abort_with_a_save_in_flight_pins_nothing() -> None:
    eng = Engine()
    eng.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=[*TOKENS, *range(40, 48)]) == 24
    eng.fill(range(20, 30), "b")
    eng.sched.save(b, range(20, 30), num_tokens=38)  # chunk 4 is new: a save in flight
    with eng.mover.stall():
        plan = eng.execute()
        assert eng.sched.abort(b) is True
        assert eng.sched.start_load(b, range(20, 30)) == 0
        assert eng.sched.stats().pool.pinned == 0
    eng.settle(plan)
    assert eng.sched.take_finished() == (b,)
    eng.quiet()


def test_a_refused_lookup_records_nothing() -> None:
    eng = Engine()
    with pytest.raises(InvalidSpecError, match="num_tokens"):
        eng.sched.lookup(RequestId("a"), block_hashes=_block_hashes(TOKENS), hash_block_tokens=4)
    with pytest.raises(InvalidSpecError, match="local_tokens"):
        eng.sched.lookup(RequestId("a"), tokens=TOKENS, local_tokens=3)
    with pytest.raises(InvalidSpecError, match="hash_block_tokens"):
        eng.sched.lookup(
            RequestId("a"), block_hashes=_block_hashes(TOKENS), hash_block_tokens=0, num_tokens=30
        )
    with pytest.raises(InvalidSpecError, match="block_hashes\\[0\\]"):
        eng.sched.lookup(RequestId("a"), block_hashes=["x"], hash_block_tokens=4, num_tokens=30)  # type: ignore[list-item]
    assert eng.sched.stats().requests == 0
    assert eng.sched.stats().lookups == 0


@pytest.mark.parametrize("world_size", [0, -1, 2, True, 1.0])
def test_a_world_size_other_than_the_engines_is_refused(world_size: object) -> None:
    config = load_config({"backend": {"kind": "cpu", "size": 1 << 20}, "chunk_tokens": CHUNK})
    with pytest.raises(InvalidSpecError, match="world_size"):
        CacheScheduler(config, ENGINE, 8, world_size=world_size)  # type: ignore[arg-type]  # hostile input


def test_a_load_refused_by_the_worker_leaves_the_chunks_cached() -> None:
    eng = Engine()
    saved = eng.serve_and_save("a", TOKENS, range(8))
    small = InMemoryBlockMover(
        num_engine_blocks=16, num_host_blocks=16, layer_block_bytes=LAYOUT.block_bytes, num_layers=2
    )
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 24
    eng.sched.start_load(b, range(40, 48))
    plan = eng.sched.take_plan()
    other = BlockWorker(small)  # a worker whose engine has fewer blocks than the scheduler was told
    other.execute(plan)
    eng.sched.complete(other.wait(plan.op_ids(), 5.0))
    assert eng.sched.take_load_errors() == {b: tuple(range(40, 46))}
    c = RequestId("c")
    assert eng.sched.lookup(c, tokens=TOKENS) == 24  # not suspect: the op was refused, not corrupt
    eng.sched.start_load(c, range(20, 28))
    eng.step()
    assert [eng.mover.read_engine_block(20 + i) for i in range(6)] == [saved[i] for i in range(6)]


def test_save_refuses_keys_of_the_other_kind() -> None:
    eng = Engine()
    a = RequestId("a")
    assert eng.sched.lookup(a, tokens=TOKENS) == 0
    with pytest.raises(InvalidSpecError, match="block_hashes"):
        eng.sched.save(a, range(8), num_tokens=30, block_hashes=_block_hashes(TOKENS), hash_block_tokens=4)


def test_a_load_the_fence_waited_for_is_still_reported() -> None:
    eng = Engine()
    eng.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 24
    eng.sched.start_load(b, range(20, 28))
    stall = contextlib.ExitStack()
    stall.enter_context(eng.mover.stall())
    eng.execute()  # the copy into b's blocks is queued behind the stall
    eng.sched.preempt(b)
    threading.Timer(0.2, stall.close).start()  # the copy runs while the fence waits for it
    eng.execute()
    eng.sched.complete(eng.worker.reports())
    assert eng.sched.stats().ops_in_flight == 0
    assert eng.sched.abort(b) is False  # nothing holds its blocks any more
    eng.sched.finish(RequestId("a"))
    eng.quiet()


def test_a_chunk_whose_fetch_failed_is_never_copied_into_the_engine() -> None:
    eng = Engine(slots=3, remote=True)
    assert eng.store is not None
    eng.serve_and_save("a", TOKENS, range(8))
    eng.serve_and_save("x", list(range(500, 530)), range(8, 16))  # a's chunks now only in the store
    b = RequestId("b")
    assert answer(eng.sched, b, TOKENS) == 24
    eng.sched.start_load(b, range(20, 28))
    mine = eng.fill(range(20, 28), "b-before")
    eng.store.fail_next(1)  # the first chunk's fetch fails: its slot holds no KV
    eng.step()
    errors = eng.sched.take_load_errors()[b]
    assert errors[:2] == (20, 21)
    assert [eng.mover.read_engine_block(b) for b in (20, 21)] == [mine[20], mine[21]]  # not overwritten
