"""Tails (``partial_chunks: keep``): the leading whole blocks of the chunk a request stops in are kept in
the local pool and served, so that a reuse recomputes less than a block of the prompt's end instead of up
to a chunk. Chunks of 8 tokens, blocks of 4: ``TOKENS`` (30) is three chunks, a whole block and 2 tokens.
"""

from __future__ import annotations

import hashlib

import pytest

from kvcore.config import load_config
from kvcore.ids import ChunkKey, RequestId
from kvcore.keying.hashing import ExtraKeys
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.scheduling.request_keys import Keyer
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore.testing.memory import InMemoryChunkStore, InMemoryStoreIndex
from tests.unit.test_scheduler import ENGINE, TOKENS
from tests.unit.test_scheduler_remote import answer
from tests.unit.test_scheduler_trust import Engine


def _keep(*, remote: bool = False, **extra: object) -> Engine:
    return Engine(8, remote, partial_chunks="keep", **extra)


def _load(eng: Engine, rid: str, tokens: list[int], blocks: range) -> int:
    """Look ``tokens`` up as request ``rid``, load into ``blocks``; returns the tokens loaded."""
    hits = eng.sched.lookup(RequestId(rid), tokens=tokens)
    assert hits is not None
    if hits:
        assert eng.sched.start_load(RequestId(rid), blocks) == hits
        eng.step()
    return hits


def test_the_same_prompt_loads_its_last_whole_block_too_byte_exact() -> None:
    eng = _keep()
    saved = eng.serve_and_save("a", TOKENS, range(8))  # three chunks and the tail of block 6
    assert eng.sched.stats().saved_blocks == 7
    assert _load(eng, "b", TOKENS, range(20, 28)) == 28  # 24 + the tail's 4; vLLM computes 2
    assert eng.sched.take_load_errors() == {}
    for i in range(7):
        assert eng.mover.read_engine_block(20 + i) == saved[i]
    assert eng.sched.extra_cached_tokens(RequestId("b")) == 28
    eng.sched.finish(RequestId("b"))
    eng.quiet()


def test_without_keep_the_prompt_stops_at_its_last_whole_chunk() -> None:
    eng = Engine()
    eng.serve_and_save("a", TOKENS, range(8))
    assert eng.sched.stats().saved_blocks == 6
    assert eng.sched.lookup(RequestId("b"), tokens=TOKENS) == 24


def test_a_next_turn_that_diverges_inside_the_chunk_loads_the_tail() -> None:
    eng = _keep()
    saved = eng.serve_and_save("a", TOKENS, range(8))
    turn2 = [*TOKENS[:28], 7, 7, 7, 7, 7, 7]  # chunk 3 differs after its first block: its full key misses
    assert _load(eng, "b", turn2, range(20, 29)) == 28
    assert [eng.mover.read_engine_block(20 + i) for i in range(7)] == [saved[i] for i in range(7)]
    other = [*TOKENS[:26], 9, 9, 9, 9, 9, 9]  # differs inside the tail's block: the tail is not served
    assert eng.sched.lookup(RequestId("c"), tokens=other) == 24


def test_the_final_tail_serves_the_next_turn_of_a_chat() -> None:
    eng = _keep()
    a = RequestId("a")
    prompt = TOKENS[:16]  # two whole chunks: no tail at the prompt's end
    assert eng.sched.lookup(a, tokens=prompt) == 0
    data = eng.fill(range(6), "a")
    grown = [*prompt, 1, 2, 3, 4, 5]  # decode computed 5 more: a whole block of chunk 2 and one token
    assert eng.sched.save(a, range(6), num_tokens=len(grown), tokens=grown) == 2
    assert eng.sched.save(a, range(6), num_tokens=len(grown), tokens=grown, final=True) == 1
    assert eng.sched.save(a, range(6), num_tokens=len(grown), tokens=grown, final=True) == 0  # once
    eng.step()
    eng.sched.finish(a)
    turn2 = [*grown, 50, 51, 52, 53]
    assert _load(eng, "b", turn2, range(30, 36)) == 20
    assert [eng.mover.read_engine_block(30 + i) for i in range(5)] == [data[i] for i in range(5)]


def test_a_tail_gone_before_the_load_is_reported_for_recompute() -> None:
    eng = _keep()
    eng.serve_and_save("a", TOKENS, range(8))
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 28
    tail = eng.sched.keyer.tail_key(eng.sched.keyer.chain(ExtraKeys(), TOKENS, None, None), 3, 1)
    assert tail is not None
    assert eng.sched.pool.remove([tail]) == 1
    assert eng.sched.start_load(b, range(20, 28)) == 24
    eng.step()
    assert eng.sched.take_load_errors() == {b: (26,)}  # the tail's block: vLLM computes it
    assert eng.sched.extra_cached_tokens(b) == 24
    eng.sched.finish(b)
    eng.quiet()
    assert eng.sched.lookup(RequestId("c"), tokens=TOKENS) == 24


def _keys(eng: Engine, tokens: list[int]) -> tuple[list[ChunkKey], ChunkKey, tuple[ChunkKey, ...]]:
    """The pool's chunk keys of ``tokens``, its prompt tail's pool key and its rank keys."""
    chain = eng.sched.keyer.chain(ExtraKeys(), tokens, None, None)
    tail = eng.sched.keyer.tail_keys(chain, len(tokens) // 8, len(tokens) % 8 // 4)
    assert tail is not None
    return list(chain.keys), tail[0], tail[1]


def test_a_tail_crosses_to_the_remote_tier_and_comes_back_from_it_byte_exact() -> None:
    eng = _keep(remote=True)
    saved = eng.serve_and_save("a", TOKENS, range(8))
    assert eng.store is not None
    assert len(eng.store) == 4  # the three chunks and the tail (one block)
    keys, tail, (ranked,) = _keys(eng, TOKENS)
    assert eng.store.peek(ranked) is not None
    assert len(eng.store.peek(ranked) or b"") == eng.mover.host_block_bytes  # its block, not a slot
    assert eng.sched.pool.remove([*keys, tail]) == 4  # gone from the pool: only the remote tier has it
    b = RequestId("b")
    assert answer(eng.sched, "b", TOKENS) == 28
    assert eng.sched.load_reads_remote(b)
    assert eng.sched.start_load(b, range(20, 28)) == 28
    eng.step()
    assert eng.sched.take_load_errors() == {}
    assert [eng.mover.read_engine_block(20 + i) for i in range(7)] == [saved[i] for i in range(7)]
    assert eng.sched.pool.lookup((tail,))  # fetched into the pool, which serves the next reuse
    eng.sched.finish(b)
    eng.quiet()


def test_the_remote_lookup_asks_for_the_prompts_tail_after_its_chunks_and_ops_carry_it_last() -> None:
    eng = _keep(remote=True)
    eng.serve_and_save("a", TOKENS, range(8))
    keys, tail, (ranked,) = _keys(eng, TOKENS)
    eng.sched.pool.remove([keys[2], tail])
    assert answer(eng.sched, "b", TOKENS) == 28  # chunk 2 and the tail from the remote tier
    assert eng.sched.start_load(RequestId("b"), range(20, 28)) == 28
    plan = eng.sched.take_plan()
    (op,) = plan.ops
    chain = eng.sched.keyer.chain(ExtraKeys(), TOKENS, None, None)
    assert (op.chain_from, op.chain) == (0, (*chain.rank_keys, (ranked,)))
    assert [c.value_blocks for c in op.remote] == [None, 1]
    eng.worker.execute(plan)
    eng.settle(plan)
    assert eng.sched.take_load_errors() == {}
    # the request grows: its next op carries chain position 3 again, now the whole chunk's key
    grown = [*TOKENS, 1, 2]
    eng.fill(range(20, 28), "b")
    assert eng.sched.save(RequestId("b"), range(20, 28), num_tokens=32, tokens=grown) == 1
    (save,) = eng.sched.take_plan().ops
    whole = eng.sched.keyer.chain(ExtraKeys(), grown, None, None).rank_keys[3]
    assert (save.chain_from, save.chain) == (3, (whole,))


def test_a_full_local_hit_answers_at_once_from_the_pools_tails_without_the_remote_tier() -> None:
    eng = _keep(remote=True)
    eng.serve_and_save("a", TOKENS, range(8))
    assert eng.store is not None
    _, tail, _ = _keys(eng, TOKENS)
    assert eng.sched.pool.remove([tail]) == 1  # the chunks are local, the tail only remote
    assert eng.index is not None
    asked = len(eng.index.asked)
    assert eng.sched.lookup(RequestId("b"), tokens=TOKENS) == 24  # no step lost waiting for the tail
    assert len(eng.index.asked) == asked


def test_a_load_decided_before_a_reset_fetches_no_tail_of_the_old_namespace() -> None:
    eng = _keep(remote=True)
    eng.serve_and_save("a", TOKENS, range(8))
    keys, tail, _ = _keys(eng, TOKENS)
    eng.sched.pool.remove([keys[2], tail])
    b = RequestId("b")
    assert answer(eng.sched, "b", TOKENS) == 28
    eng.sched.reset()
    eng.sched.start_load(b, range(20, 28))
    assert all(not op.remote for op in eng.sched.take_plan().ops)


def test_a_requests_last_tail_stays_in_the_pool() -> None:
    eng = _keep(remote=True)
    a = RequestId("a")
    prompt = TOKENS[:16]  # two whole chunks: no tail at the prompt's end
    assert answer(eng.sched, "a", prompt) == 0
    eng.fill(range(6), "a")
    grown = [*prompt, 1, 2, 3, 4, 5]
    assert eng.sched.save(a, range(6), num_tokens=len(grown), tokens=grown) == 2
    assert eng.sched.save(a, range(6), num_tokens=len(grown), tokens=grown, final=True) == 1
    eng.step()
    assert eng.store is not None
    assert len(eng.store) == 2  # a next turn's lookup never asks the remote tier for it
    assert eng.sched.stats().pool.used == 3


def test_a_tail_whose_chunk_is_keyed_whole_stays_in_the_pool() -> None:
    eng = _keep(remote=True)
    a = RequestId("a")
    assert answer(eng.sched, "a", TOKENS) == 0
    eng.fill(range(8), "a")
    grown = [*TOKENS, 1, 2]  # the first save already sees chunk 3 whole (32 tokens)
    assert eng.sched.save(a, range(8), num_tokens=32, tokens=grown) == 5  # four chunks and the tail
    eng.step()
    assert eng.store is not None
    assert len(eng.store) == 4  # the chunks only: position 3 is the whole chunk's in the remote chain
    eng.sched.finish(a)


def test_with_two_sightings_needed_the_prompts_tail_waits_for_its_second_sighting() -> None:
    eng = _keep(save_after_sightings=2)
    eng.serve_and_save("a", TOKENS, range(8))
    assert eng.sched.stats().saved_blocks == 0
    b = RequestId("b")
    assert eng.sched.lookup(b, tokens=TOKENS) == 0
    eng.fill(range(8), "b")
    assert eng.sched.save(b, range(8), num_tokens=len(TOKENS)) == 4
    eng.step()
    eng.sched.finish(b)
    assert eng.sched.lookup(RequestId("c"), tokens=TOKENS) == 28


def test_a_request_live_at_a_reset_saves_no_tail() -> None:
    eng = _keep()
    a = RequestId("a")
    assert eng.sched.lookup(a, tokens=TOKENS) == 0
    eng.fill(range(8), "a")
    eng.sched.reset()
    assert eng.sched.save(a, range(8), num_tokens=len(TOKENS), final=True) == 0


def test_without_a_local_pool_the_tail_is_saved_to_the_remote_tier_alone() -> None:
    config = load_config(
        {"backend": {"kind": "cpu", "size": 1 << 20}, "chunk_tokens": 8, "partial_chunks": "keep"}
    )
    sched = CacheScheduler(
        config, ENGINE, 0, remote=InMemoryStoreIndex(InMemoryChunkStore(bytearray(64)).exists)
    )
    assert answer(sched, "a", TOKENS) == 0
    assert sched.save(RequestId("a"), range(8), num_tokens=len(TOKENS), final=True) == 4
    (op,) = sched.take_plan().ops
    assert [(c.slot, c.count, c.value_blocks) for c in op.remote] == [(None, 2, None)] * 3 + [(None, 1, 1)]


def _block_hashes(tokens: list[int], per: int) -> list[bytes]:
    """A chained per-block hash as an engine would make it (whole blocks only)."""
    out: list[bytes] = []
    parent = b"root"
    for i in range(0, len(tokens) - len(tokens) % per, per):
        parent = hashlib.sha256(parent + bytes(str(tokens[i : i + per]), "ascii")).digest()
        out.append(parent)
    return out


def test_tails_from_an_engines_block_hashes() -> None:
    eng = _keep()
    a, b = RequestId("a"), RequestId("b")
    hashes = _block_hashes(TOKENS, 4)
    assert eng.sched.lookup(a, block_hashes=hashes, hash_block_tokens=4, num_tokens=len(TOKENS)) == 0
    data = eng.fill(range(8), "a")
    assert eng.sched.save(a, range(8), num_tokens=len(TOKENS), block_hashes=hashes, hash_block_tokens=4) == 4
    eng.step()
    eng.sched.finish(a)
    assert eng.sched.lookup(b, block_hashes=hashes, hash_block_tokens=4, num_tokens=len(TOKENS)) == 28
    assert eng.sched.start_load(b, range(20, 28)) == 28
    eng.step()
    assert [eng.mover.read_engine_block(20 + i) for i in range(7)] == [data[i] for i in range(7)]


# -- keys ---------------------------------------------------------------------------------------------------

WIDE = EngineSpec(
    model_id="tiny",
    kv_dtype="int8",
    num_layers=2,
    total_kv_heads=2,
    layout=KVLayout(
        LayoutKind.VLLM_CPU, num_blocks=64, block_tokens=4, num_kv_heads=2, head_size=2, dtype_size=1
    ),
)


@pytest.mark.parametrize("by_hashes", [False, True], ids=["tokens", "block-hashes"])
def test_every_tail_has_a_key_of_its_own(by_hashes: bool) -> None:
    config = load_config(
        {"backend": {"kind": "cpu", "size": 1 << 20}, "chunk_tokens": 16, "partial_chunks": "keep"}
    )
    keyer = Keyer(config, WIDE, hash_identity="engine" if by_hashes else None, shard_keys=False)
    tokens = list(range(40))
    if by_hashes:
        chain = keyer.chain(ExtraKeys(), None, _block_hashes(tokens, 4), 4)
    else:
        chain = keyer.chain(ExtraKeys(), tokens, None, None)
    # 40 tokens: two chunks of 16, then two whole blocks
    tails = [keyer.tail_key(chain, chunk, blocks) for chunk in range(2) for blocks in (1, 2, 3)]
    tails += [keyer.tail_key(chain, 2, 1), keyer.tail_key(chain, 2, 2)]
    assert None not in tails
    assert len({*tails, *chain.keys}) == len(tails) + len(chain.keys)  # no tail is a chunk or another tail
    assert keyer.tail_key(chain, 2, 3) is None  # its tokens are not known yet
    assert keyer.tail_key(chain, 3, 1) is None
    assert keyer.tail_key(chain, 0, 4) is None  # a whole chunk is not a tail
    # a prefix's tails are the whole sequence's: keys depend on the tokens before and in them only
    prefix = tokens[:36]
    if by_hashes:
        short = keyer.chain(ExtraKeys(), None, _block_hashes(prefix, 4), 4)
    else:
        short = keyer.chain(ExtraKeys(), prefix, None, None)
    assert keyer.tail_key(short, 2, 1) == keyer.tail_key(chain, 2, 1)


def test_a_load_decided_before_a_failure_of_the_tail_is_not_started() -> None:
    eng = _keep()
    eng.serve_and_save("a", TOKENS, range(8))
    c = RequestId("c")
    assert eng.sched.lookup(c, tokens=TOKENS, local_tokens=24) == 4  # the tail alone
    assert eng.sched.start_load(c, range(20, 28)) == 4
    assert eng.sched.lookup(c, tokens=TOKENS, local_tokens=24) == 4  # asked again while it copies
    eng.mover.fail_next(1)
    eng.step()
    assert eng.sched.take_load_errors() == {c: (26,)}
    # the load decided before the failure loads nothing, and says so: the engine was told 4 tokens
    assert eng.sched.start_load(c, range(20, 28)) == 0
    assert eng.sched.take_load_errors() == {c: (26,)}
    assert eng.sched.lookup(c, tokens=TOKENS, local_tokens=24) == 0  # the failed tail is not served again


def test_a_load_of_the_tail_alone_reads_nothing_remote() -> None:
    eng = _keep(remote=True)
    eng.serve_and_save("a", TOKENS, range(8))
    keys = eng.sched.keyer.chain(ExtraKeys(), TOKENS, None, None).keys
    eng.sched.pool.remove(list(keys[1:3]))  # chunks 1 and 2 only in the remote tier now
    b, c = RequestId("b"), RequestId("c")
    hits = None
    while hits is None:
        hits = eng.sched.lookup(b, tokens=TOKENS, local_tokens=24)  # the engine holds chunks 0 to 2
    assert hits == 4
    assert not eng.sched.load_reads_remote(b)
    assert answer(eng.sched, "c", TOKENS) == 28
    assert eng.sched.load_reads_remote(c)  # chunks 1 and 2 come from the remote tier
