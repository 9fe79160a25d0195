"""The scheduler's read locks handed to the workers (``SupportsHeldLookups``), against a real server.

A held lookup keeps the chunks it answered read-locked, one lookup per rank (per KV head of each rank:
the server keeps a value per head); the load carries the locks
to the workers, whose retrieve prepares those chunks under them with no lookup of its own and releases
what it does not read. Every path must leave the server with no lock of the request's: a finished,
aborted or preempted request, a load that reads less than the lookup found, and a lock too old to hand
over. A server restart or a lapsed lock between lookup and load is a miss (recomputed), never bytes the
load was not meant to read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import partial

import pytest
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

from kvcore.ids import ChunkKey, RequestId
from kvcore.keying.keys import head_keys
from kvcore.testing.counting import CallCounter
from kvcore.testing.slow_link import SlowLink
from kvcore.testing.support import SETTLE_S, settle
from kvcore_lmcache import LMCacheChunkIndex
from kvcore_lmcache.config import LMCacheMPConfig
from kvcore_lmcache.tier import LMCacheManagedTier
from tests.lmcache.conftest import CHUNK_TOKENS, LMCacheServer, ServerFactory
from tests.lmcache.direct_rig import (
    BLOCK,
    CHUNKS,
    PER_CHUNK,
    Engine,
    EngineFactory,
    engine_spec,
    prompt,
    save,
)
from tests.lmcache.raw import RawClient

BLOCKS = CHUNKS * PER_CHUNK
INTO = range(20, 20 + BLOCKS)  # where engine B loads


def _count_worker_calls(engine: Engine) -> list[CallCounter]:
    counted = []
    for worker in engine.workers:
        tier = getattr(worker.remote, "tier", None)
        assert isinstance(tier, LMCacheManagedTier)
        client = CallCounter(tier.link.client)
        tier.link.client = client  # counts, then forwards every call
        counted.append(client)
    return counted


def _unlocked(server: LMCacheServer, left: int = 0) -> bool:
    """Whether the server's read-locked chunks come down to ``left`` (releases leave on a clean-up
    thread: wait for them)."""
    deadline = time.monotonic() + SETTLE_S
    while server.read_locked() != left:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _tier(engine: Engine) -> LMCacheManagedTier:
    tier = getattr(engine.workers[0].remote, "tier", None)
    assert isinstance(tier, LMCacheManagedTier)
    return tier


@contextlib.contextmanager
def _other_reader(server: LMCacheServer, engine: Engine) -> Iterator[int]:
    """Another client's read lock on every chunk of each KV head that ``engine``'s last save stored, as a
    third engine's lookup would hold it, kept until the block ends; yields how many chunks that is.
    The server counts locked chunks, not locks: a release of ours that took one of these shows as a
    chunk no longer locked, and a lock of ours left behind as one still locked after the block."""
    (op,) = engine.plans[-1].ops
    heads = [[head_keys(key) for key in keys] for keys in op.chain]  # chunk, rank, head
    chains = {
        tuple(chunk[rank][head] for chunk in heads)
        for rank, per_rank in enumerate(heads[0])
        for head in range(len(per_rank))
    }
    codec = _tier(engine).link.codec
    client = RequestClientFactory.create(server.url)
    sessions: list[tuple[str, tuple[ChunkKey, ...]]] = []
    try:
        for n, chain in enumerate(chains):
            session = f"other-reader-{n}"
            client.lookup(codec.ipc_key(session, chain, 0, len(chain), None), 1).result(timeout=SETTLE_S)
            sessions.append((session, chain))
            deadline = time.monotonic() + SETTLE_S
            while client.query_prefetch_status(session).result(timeout=SETTLE_S) is None:
                assert time.monotonic() < deadline, "the other reader's lookup never finished"
        assert server.read_locked() == CHUNKS * len(chains)
        yield CHUNKS * len(chains)
    finally:
        for session, chain in sessions:
            key = codec.ipc_key(session, chain, 0, len(chain), None)
            client.free_lookup_locks(key, 1).result(timeout=SETTLE_S)
            client.end_session(session).result(timeout=SETTLE_S)
        client.close()


def _still_locked(server: LMCacheServer, locked: int) -> bool:
    """Whether the other reader's locks all survived our releases, once those had time to arrive."""
    time.sleep(0.3)
    return server.read_locked() == locked


@pytest.fixture
def server(server_factory: ServerFactory) -> LMCacheServer:
    """A server of the test's own: its lock count is the test's alone."""
    made = server_factory()
    made.start()
    return made


@pytest.mark.parametrize(("tp", "kv_heads"), [(1, None), (2, None), (2, 1)], ids=["tp1", "tp2", "tp2-shared"])
def test_a_load_reads_under_the_schedulers_locks_and_releases_them_all(
    tp: int, kv_heads: int | None, server: LMCacheServer, engines: EngineFactory
) -> None:
    spec = engine_spec(tp, kv_heads)
    a, b = engines(spec, seed=1, server=server), engines(spec, seed=2, server=server)
    tokens = prompt(21)
    save(a, "a", tokens)
    assert server.read_locked() == 0
    counted = _count_worker_calls(b)
    with _other_reader(server, a) as locked:
        assert locked == CHUNKS * (2 * tp if kv_heads is None else kv_heads)
        assert b.lookup("b", tokens) == CHUNKS * CHUNK_TOKENS
        b.sched.start_load(RequestId("b"), list(INTO))
        b.step()
        (op,) = b.plans[-1].ops
        assert op.held is not None
        assert len(op.held.holders) == tp
        assert b.sched.take_load_errors() == {}
        for rank in range(tp):  # a shared shard is written by rank 0 alone, and read by every rank
            assert b.blocks(rank, INTO) == a.blocks(rank if kv_heads is None else 0, range(BLOCKS))
        assert [c.calls["lookup"] for c in counted] == [0] * tp  # no lookup of the workers' own
        local = spec.layout.num_kv_heads
        assert [c.calls["prepare_retrieve"] for c in counted] == [local] * tp  # one per head
        b.sched.finish(RequestId("b"))
        b.step()
        assert _still_locked(server, locked)
    assert _unlocked(server)  # every rank's prepare consumed its own lock, nothing lingers


@pytest.mark.parametrize(("tp", "kv_heads"), [(1, None), (2, None), (2, 1)], ids=["tp1", "tp2", "tp2-shared"])
def test_a_prompts_tail_travels_through_the_server_under_the_handed_over_locks(
    tp: int, kv_heads: int | None, server: LMCacheServer, engines: EngineFactory
) -> None:
    spec = engine_spec(tp, kv_heads)
    a, b = engines(spec, seed=7, server=server), engines(spec, seed=8, server=server)
    tokens = prompt(24, tail_blocks=PER_CHUNK - 1)  # the tail: all but one block of a chunk
    save(a, "a", tokens)
    (stored,) = a.plans[-1].ops
    assert [c.value_blocks for c in stored.remote] == [None] * CHUNKS + [PER_CHUNK - 1]
    assert len(stored.chain) == CHUNKS + 1  # the tail is the chain's position after the chunks
    counted = _count_worker_calls(b)
    cached = CHUNKS * CHUNK_TOKENS + (PER_CHUNK - 1) * BLOCK
    assert b.lookup("b", tokens) == cached  # LMCache's own connector: CHUNKS * CHUNK_TOKENS
    into = list(range(20, 20 + BLOCKS + PER_CHUNK))
    assert b.sched.start_load(RequestId("b"), into) == cached
    b.step()
    (op,) = b.plans[-1].ops
    assert op.held is not None
    assert op.held.end == CHUNKS + 1
    assert b.sched.take_load_errors() == {}
    loaded = BLOCKS + PER_CHUNK - 1
    for rank in range(tp):  # a shared shard, the tail's too, is written by rank 0 alone
        assert b.blocks(rank, range(20, 20 + loaded)) == a.blocks(
            rank if kv_heads is None else 0, range(loaded)
        )
    local = spec.layout.num_kv_heads  # a prepare per KV head
    assert [(c.calls["lookup"], c.calls["prepare_retrieve"]) for c in counted] == [(0, local)] * tp
    assert _unlocked(server)
    # a prompt that ends one block earlier has another tail: the chunks are found, its tail is not
    assert b.lookup("c", tokens[:-BLOCK]) == CHUNKS * CHUNK_TOKENS
    b.sched.finish(RequestId("b"))
    b.sched.finish(RequestId("c"))
    b.step()
    assert _unlocked(server)


def test_without_the_hand_over_each_worker_locks_with_a_lookup_of_its_own(
    server: LMCacheServer, engines: EngineFactory
) -> None:
    spec = engine_spec(1)
    a, b = engines(spec, seed=3, server=server), engines(spec, seed=4, server=server, lock_handover_s=0)
    tokens = prompt(22)
    save(a, "a", tokens)
    (counted,) = _count_worker_calls(b)
    assert b.lookup("b", tokens) == CHUNKS * CHUNK_TOKENS
    assert _unlocked(server)  # a plain lookup keeps nothing
    b.sched.start_load(RequestId("b"), list(INTO))
    b.step()
    assert b.sched.take_load_errors() == {}
    assert b.blocks(0, INTO) == a.blocks(0, range(BLOCKS))
    assert counted.calls["lookup"] == spec.layout.num_kv_heads  # one per KV head
    assert _unlocked(server)


def test_a_load_is_done_once_its_copies_are_in_a_round_trip_before_its_commit_is_answered(
    server: LMCacheServer, engines: EngineFactory
) -> None:
    """A retrieve's result is handed over when its copies are done: its commit only ends the server's
    read (answered later, its lock released then). Behind a link of ``delay`` each way, a load under
    the handed-over locks takes one round trip (the prepare), not two."""
    delay = 0.25
    spec = engine_spec(1)
    a = engines(spec, seed=16, server=server)
    tokens = prompt(28)
    save(a, "a", tokens)
    host, port = server.url.removeprefix("tcp://").rsplit(":", 1)
    with SlowLink((host, int(port))) as link:
        b = engines(spec, seed=17, server=server, url="tcp://{}:{}".format(*link.address))
        assert b.lookup("b", tokens) == CHUNKS * CHUNK_TOKENS
        link.delay_s = delay
        b.sched.start_load(RequestId("b"), list(INTO))
        started = time.monotonic()
        b.step()
        took = time.monotonic() - started
        assert b.sched.take_load_errors() == {}
        assert b.blocks(0, INTO) == a.blocks(0, range(BLOCKS))
        assert took < 3.5 * delay  # one round trip (2 delays) and the copies; two would be 4 delays
        b.sched.finish(RequestId("b"))
        b.step()
        assert _unlocked(server)  # the commit, answered later, ended the read
        link.delay_s = 0.0


def test_locks_the_load_does_not_read_are_released_once_it_ran(
    server: LMCacheServer, engines: EngineFactory
) -> None:
    spec = engine_spec(1)
    a, b = engines(spec, seed=5, server=server), engines(spec, seed=6, server=server)
    tokens = prompt(23)
    save(a, "a", tokens)
    with _other_reader(server, a) as locked:
        local = CHUNK_TOKENS  # the engine's own prefix cache holds the first chunk: the load reads two
        assert b.lookup("b", tokens, local_tokens=local) == (CHUNKS - 1) * CHUNK_TOKENS
        b.sched.start_load(RequestId("b"), list(INTO))
        b.step()
        assert b.sched.take_load_errors() == {}
        assert b.blocks(0, INTO[PER_CHUNK:]) == a.blocks(0, range(PER_CHUNK, BLOCKS))
        assert _still_locked(server, locked)
    assert _unlocked(server)  # the first chunk's lock too, while the request still runs


@pytest.mark.parametrize("end", ["finish", "abort", "preempt", "no load"])
def test_a_request_that_never_loads_releases_what_its_lookup_locked(
    end: str, server: LMCacheServer, engines: EngineFactory
) -> None:
    spec = engine_spec(2)
    a, b = engines(spec, seed=7, server=server), engines(spec, seed=8, server=server)
    tokens = prompt(24)
    save(a, "a", tokens)
    request = RequestId("b")
    if end == "no load":  # the engine holds the whole prompt itself: there is nothing to load
        with _other_reader(server, a) as locked:
            assert b.lookup("b", tokens, local_tokens=len(tokens) - 5) == 0
            b.step()
            assert _still_locked(server, locked)
        assert _unlocked(server)
        return
    assert b.lookup("b", tokens) == CHUNKS * CHUNK_TOKENS
    assert server.read_locked() == 4 * CHUNKS  # two ranks, two KV heads each
    with _other_reader(server, a) as locked:
        ending: Callable[[RequestId], object] = {
            "finish": b.sched.finish,
            "abort": b.sched.abort,
            "preempt": b.sched.preempt,
        }[end]
        ending(request)
        b.step()
        assert _still_locked(server, locked)
    assert _unlocked(server)


def test_a_lock_too_old_to_hand_over_is_released_and_the_worker_locks_afresh(
    server: LMCacheServer, engines: EngineFactory
) -> None:
    spec = engine_spec(1)
    a, b = engines(spec, seed=9, server=server), engines(spec, seed=10, server=server, lock_handover_s=0.2)
    tokens = prompt(25)
    save(a, "a", tokens)
    (counted,) = _count_worker_calls(b)
    assert b.lookup("b", tokens) == CHUNKS * CHUNK_TOKENS
    time.sleep(0.4)  # the engine took its time to allocate the blocks
    b.sched.start_load(RequestId("b"), list(INTO))
    b.step()
    (op,) = b.plans[-1].ops
    assert op.held is None
    assert b.sched.take_load_errors() == {}
    assert b.blocks(0, INTO) == a.blocks(0, range(BLOCKS))
    assert counted.calls["lookup"] == spec.layout.num_kv_heads  # a fresh lookup of the worker's own, per head
    assert _unlocked(server)


def test_a_server_restart_between_lookup_and_load_is_a_miss_not_the_new_servers_bytes(
    server: LMCacheServer, engines: EngineFactory
) -> None:
    spec = engine_spec(1)
    a, b, c = (engines(spec, seed=seed, server=server) for seed in (11, 12, 13))
    tokens = prompt(26)
    save(a, "a", tokens)
    assert b.lookup("b", tokens) == CHUNKS * CHUNK_TOKENS  # locked on the server that is about to go
    server.restart()  # empty, in a new shared-memory segment
    deadline = time.monotonic() + 6 * SETTLE_S
    while True:  # engine C saves the same prompt, other bytes, on the new server
        request = RequestId(f"c-{time.monotonic()}")
        if c.lookup(request, tokens) == 0:
            c.sched.save(request, list(range(BLOCKS)), len(tokens))
        c.sched.finish(request)  # its lookup's locks go: C reads nothing
        c.step()
        pool = _tier(b).link.segment
        if c.sched.stats().saved_blocks and _tier(b).link.available() and pool and not pool.stale():
            break
        assert time.monotonic() < deadline, "the server never came back"
        time.sleep(0.2)
    assert _unlocked(server)
    before = b.blocks(0, INTO)
    b.sched.start_load(RequestId("b"), list(INTO))
    b.step()
    assert b.plans[-1].ops[0].held is not None  # handed over: locks of the server that went
    assert sorted(b.sched.take_load_errors()[RequestId("b")]) == list(INTO)  # recomputed, all of it
    assert b.blocks(0, INTO) == before  # nothing written, C's bytes least of all
    assert _unlocked(server)


def test_a_lock_that_lapsed_before_the_load_is_a_miss(
    server_factory: ServerFactory, engines: EngineFactory
) -> None:
    server = server_factory(options=["--l1-read-ttl-seconds", "1"])
    server.start()
    spec = engine_spec(1)
    a, b = engines(spec, seed=14, server=server), engines(spec, seed=15, server=server)
    tokens = prompt(27)
    save(a, "a", tokens)
    assert b.lookup("b", tokens) == CHUNKS * CHUNK_TOKENS
    time.sleep(1.5)  # past the server's read-lock TTL, within the hand-over's 60 s
    assert server.read_locked() == 0
    before = b.blocks(0, INTO)
    b.sched.start_load(RequestId("b"), list(INTO))
    b.step()
    assert b.plans[-1].ops[0].held is not None
    assert sorted(b.sched.take_load_errors()[RequestId("b")]) == list(INTO)
    assert b.blocks(0, INTO) == before
    assert b.lookup("again", tokens) == CHUNKS * CHUNK_TOKENS  # the chunks are still there: a new lookup
    b.sched.start_load(RequestId("again"), list(INTO))
    b.step()
    assert b.sched.take_load_errors() == {}
    assert b.blocks(0, INTO) == a.blocks(0, range(BLOCKS))
    assert _unlocked(server)


def test_the_index_releases_each_lock_once_and_never_another_readers(server: LMCacheServer) -> None:
    """A held lookup after a chunk the local pool holds releases that chunk's lock before it answers,
    and the chunks it kept when released: a second release of the first chunk would take the lock
    another reader holds on it (the server's counts are anonymous)."""
    model, value_bytes = f"org/held-{time.monotonic_ns()}", 4096
    config = LMCacheMPConfig(url=server.url, request_timeout_s=SETTLE_S / 2)
    raw = RawClient(server.url, model, value_bytes, CHUNK_TOKENS)
    index = LMCacheChunkIndex(config, value_bytes=value_bytes, chunk_tokens=CHUNK_TOKENS, model_name=model)
    try:
        keys = [ChunkKey(f"held/{time.monotonic_ns()}/{i}") for i in range(3)]
        for i, key in enumerate(keys):
            raw.poke(key, bytes(value_bytes), keys[:i])
        other = raw.lock(keys[:1])  # another reader's lock on the first chunk, kept
        for _ in range(2):
            lookup_id = index.submit_held_lookup([[key] for key in keys[1:]], [keys[:1]])
            assert settle(partial(index.poll_lookup, lookup_id), "the held lookup") == 2
            held = index.take_held(lookup_id)
            assert held is not None
            assert (held.start, held.end) == (1, 3)
            index.release_held(held)
        assert _unlocked(server, left=1)  # the other reader's lock on the first chunk
        raw.unlock(other, keys[:1])
        assert _unlocked(server)
    finally:
        index.close()
        raw.close()
