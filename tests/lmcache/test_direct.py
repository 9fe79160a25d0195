"""Engine blocks straight into and out of a real LMCache server's slots (no ``local_size``: no host pool).

Two engines of the same model, each a scheduler and its ranks' workers as the vLLM adapter composes them
(``kvcore.plugins.compose``), share one server: what engine A saves from its KV blocks, engine B loads into
its own, byte for byte, with no host memory of either engine in between.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
import torch

from kvcore.ids import ChunkKey, RequestId
from kvcore.ports import BlockItem
from kvcore.testing.faults import TransferGate
from kvcore.testing.support import SETTLE_S
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.tier import MappedMovers
from kvcore_lmcache import LMCacheManagedTier
from kvcore_lmcache.config import LMCacheMPConfig
from tests.lmcache.conftest import CHUNK_TOKENS, LMCacheServer
from tests.lmcache.direct_rig import BLOCK, CHUNKS, PER_CHUNK, EngineFactory, engine_spec, prompt, save


@pytest.mark.parametrize("tp", [1, 2])
def test_blocks_travel_engine_to_server_to_engine_byte_for_byte(tp: int, engines: EngineFactory) -> None:
    spec = engine_spec(tp)
    a, b = engines(spec, seed=1), engines(spec, seed=2)
    assert all(w.host is None and w.mover is None for w in a.workers)  # no host pool in between
    tokens = prompt(11)
    save(a, "a", tokens)
    assert b.lookup("b", tokens) == CHUNKS * CHUNK_TOKENS
    into = range(20, 20 + CHUNKS * PER_CHUNK)
    assert b.sched.start_load(RequestId("b"), list(into)) == CHUNKS * CHUNK_TOKENS
    b.step()
    (op,) = b.plans[-1].ops
    assert op.host_blocks == ()
    assert all(c.slot is None for c in op.remote)
    assert b.sched.take_load_errors() == {}
    for rank in range(tp):
        assert b.blocks(rank, into) == a.blocks(rank, range(CHUNKS * PER_CHUNK))


def test_a_load_may_start_inside_a_chunk(engines: EngineFactory) -> None:
    spec = engine_spec(1)
    a, b = engines(spec, seed=3), engines(spec, seed=4)
    tokens = prompt(12)
    save(a, "a", tokens)
    local = BLOCK  # the engine holds the first block itself
    assert b.lookup("b", tokens, local_tokens=local) == CHUNKS * CHUNK_TOKENS - local
    ids = list(range(30, 30 + CHUNKS * PER_CHUNK))
    b.sched.start_load(RequestId("b"), ids)
    b.step()
    assert b.sched.take_load_errors() == {}
    assert b.blocks(0, range(31, 30 + CHUNKS * PER_CHUNK)) == a.blocks(0, range(1, CHUNKS * PER_CHUNK))
    assert b.blocks(0, range(30, 31)) != a.blocks(0, range(1))  # the block it held was not loaded


def test_a_second_save_of_held_chunks_sends_nothing(engines: EngineFactory) -> None:
    spec = engine_spec(1)
    a = engines(spec, seed=5)
    tokens = prompt(13)
    save(a, "a", tokens)
    assert a.lookup("again", tokens) == CHUNKS * CHUNK_TOKENS
    assert a.sched.save(RequestId("again"), list(range(CHUNKS * PER_CHUNK)), len(tokens)) == 0


def test_a_restarted_server_is_mapped_again_and_serves_new_saves(
    server_factory: Callable[[int], LMCacheServer], engines: EngineFactory
) -> None:
    server = server_factory(CHUNK_TOKENS)
    server.start()
    spec = engine_spec(1)
    a, b = engines(spec, seed=6, server=server), engines(spec, seed=7, server=server)
    save(a, "before", prompt(14))
    server.restart()  # an empty cache in a new shared-memory segment
    tokens = prompt(15)
    deadline = time.monotonic() + 6 * SETTLE_S
    while True:  # the heartbeat finds the server again; until then saves fail and lookups miss
        saved_before = a.sched.stats().saved_blocks
        request = f"after-{time.monotonic()}"
        if a.lookup(request, tokens) == 0:
            a.sched.save(RequestId(request), list(range(CHUNKS * PER_CHUNK)), len(tokens))
            a.step()
            if a.sched.stats().saved_blocks > saved_before and b.lookup(f"probe-{request}", tokens) > 0:
                break
        assert time.monotonic() < deadline, "saves never resumed after the restart"
        time.sleep(0.2)
    assert b.lookup("b", tokens) == CHUNKS * CHUNK_TOKENS
    b.sched.start_load(RequestId("b"), list(range(10, 10 + CHUNKS * PER_CHUNK)))
    b.step()
    assert b.sched.take_load_errors() == {}
    assert b.blocks(0, range(10, 10 + CHUNKS * PER_CHUNK)) == a.blocks(0, range(CHUNKS * PER_CHUNK))


def test_a_store_abandoned_during_its_copy_never_serves_what_it_read(lmcache_server: LMCacheServer) -> None:
    spec = engine_spec(1)
    config = LMCacheMPConfig(url=lmcache_server.url, request_timeout_s=SETTLE_S)
    value_bytes = PER_CHUNK * spec.host_block_bytes
    tiers, kvs, gate = [], [], TransferGate(SETTLE_S)
    for seed in (8, 9):
        bits = torch.randint(
            -(2**15), 2**15, spec.layout.shape, dtype=torch.int16, generator=torch.manual_seed(seed)
        )
        kv = EngineKV.register(
            [bits.view(torch.bfloat16).clone() for _ in range(spec.num_layers)], spec.layout
        )
        movers = MappedMovers(kv, faults=gate if seed == 8 else None)
        tier = LMCacheManagedTier(
            config,
            None,
            value_bytes=value_bytes,
            chunk_tokens=CHUNK_TOKENS,
            model_name=spec.model_id,
            block_movers=movers,
            block_bytes=spec.host_block_bytes,
        )
        tiers.append(tier)
        kvs.append(kv)
    a, b = tiers
    try:
        keys = [ChunkKey(f"abandoned/{uuid.uuid4().hex}/{i}") for i in range(2)]
        items = [BlockItem(k, range(i * PER_CHUNK, (i + 1) * PER_CHUNK)) for i, k in enumerate(keys)]
        job = a.submit_store_blocks(RequestId("a"), items)
        assert gate.entered.wait(SETTLE_S), "the copy never started"
        a.abandon(job)  # the engine may overwrite these blocks from now on
        gate.opened.set()
        (result,) = a.wait([job], SETTLE_S)
        assert result.failed == (0, 1)
        before = [bytes(p[40 : 40 + 2 * PER_CHUNK].numpy().tobytes()) for p in kvs[1].planes]
        into = [BlockItem(k, range(40 + i * PER_CHUNK, 40 + (i + 1) * PER_CHUNK)) for i, k in enumerate(keys)]
        (loaded,) = b.wait([b.submit_retrieve_blocks(RequestId("b"), into)], SETTLE_S)
        assert loaded.failed == (0, 1)  # a miss: nothing of what the abandoned copy read is served
        assert [bytes(p[40 : 40 + 2 * PER_CHUNK].numpy().tobytes()) for p in kvs[1].planes] == before
    finally:
        for tier in tiers:
            tier.close()


def test_a_retrieve_abandoned_during_its_copy_says_so_and_one_abandoned_before_copies_nothing(
    lmcache_server: LMCacheServer,
) -> None:
    spec = engine_spec(1)
    config = LMCacheMPConfig(url=lmcache_server.url, request_timeout_s=SETTLE_S)
    gate = TransferGate(SETTLE_S)
    bits = torch.randint(
        -(2**15), 2**15, spec.layout.shape, dtype=torch.int16, generator=torch.manual_seed(3)
    )
    kv = EngineKV.register([bits.view(torch.bfloat16).clone() for _ in range(spec.num_layers)], spec.layout)
    movers = MappedMovers(kv, faults=gate)
    tier = LMCacheManagedTier(
        config,
        None,
        value_bytes=PER_CHUNK * spec.host_block_bytes,
        chunk_tokens=CHUNK_TOKENS,
        model_name=spec.model_id,
        block_movers=movers,
        block_bytes=spec.host_block_bytes,
    )

    def blocks(first: int) -> list[bytes]:
        return [bytes(p[first : first + PER_CHUNK].numpy().tobytes()) for p in kv.planes]

    try:
        key = ChunkKey(f"retrieve-abandoned/{uuid.uuid4().hex}")
        gate.opened.set()  # the store copies at once
        (stored,) = tier.wait(
            [tier.submit_store_blocks(RequestId("s"), [BlockItem(key, range(PER_CHUNK))])], SETTLE_S
        )
        assert stored.ok
        saved = blocks(0)
        gate.opened.clear()
        gate.entered.clear()
        copying = tier.submit_retrieve_blocks(RequestId("r1"), [BlockItem(key, range(20, 20 + PER_CHUNK))])
        assert gate.entered.wait(SETTLE_S), "the copy never started"
        queued = tier.submit_retrieve_blocks(RequestId("r2"), [BlockItem(key, range(40, 40 + PER_CHUNK))])
        assert tier.abandon(copying)  # its copy into the engine's blocks runs: wait for the job
        assert not tier.abandon(queued)  # not started: no copy will
        untouched = blocks(40)
        gate.opened.set()
        results = {r.job_id: r for r in tier.wait([copying, queued], SETTLE_S)}
        assert results[queued].failed == (0,)
        assert blocks(40) == untouched
        assert blocks(20) == saved  # the copy that ran was whole
    finally:
        tier.close()
