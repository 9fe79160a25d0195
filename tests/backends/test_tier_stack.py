"""A stack of tiers on engines stepped by hand (real workers, host pools, disk tiers): a pool too small for
the workload in front of two disk tiers (two directories, as a local NVMe and a slower shared disk
would be). Hits come from the pool, then the first disk, then the second once the first lost the
chunks; every loaded byte is the byte saved; a chunk saved through the stack is admitted by each tier
per its rule; a stack of the pool and one disk tier behaves as ``{"backend": {"kind": "disk"}}``."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from kvcore.config import load_config
from kvcore.errors import ConfigError
from kvcore.ids import RequestId
from kvcore.keying.hashing import ExtraKeys
from kvcore.keying.keys import head_keys
from kvcore.plugins.compose import open_scheduler
from kvcore.pool.block_pool import PoolEventKind
from kvcore.testing.support import SETTLE_S
from kvcore_disk.directory import ChunkDirectory
from tests.hand_engine import BLOCK, CHUNK_TOKENS, CHUNKS, PER_CHUNK, Engine, engine_spec, prompt, save

CHUNK_BYTES = 32 * 1024  # per rank: 2 layers x K,V x 2 heads x 128 tokens x 16 x bf16
POOL_CHUNKS = CHUNKS  # one prompt's chunks: a second prompt pushes the first out
HEADS = 2  # KV heads per rank: a disk tier keeps a file per head of each chunk


def stack(tmp_path: Path, tp: int, admit_after: int = 1) -> dict[str, Any]:
    for name in ("nvme", "shared"):
        (tmp_path / name).mkdir(exist_ok=True)
    return {
        "chunk_tokens": CHUNK_TOKENS,
        "tiers": [
            {"kind": "cpu", "size": POOL_CHUNKS * CHUNK_BYTES * tp},
            {"kind": "disk", "path": str(tmp_path / "nvme"), "size": "64MiB", "admit_after": admit_after},
            {"kind": "disk", "path": str(tmp_path / "shared"), "size": "64MiB"},
        ],
    }


def load(engine: Engine, request: str, tokens: list[int], at: int) -> int:
    """Look ``tokens`` up and load what was found into blocks ``at``...; the tokens loaded."""
    found = engine.lookup(request, tokens)
    if found:
        into = list(range(at, at + -(-len(tokens) // (CHUNK_TOKENS // PER_CHUNK))))
        assert engine.sched.start_load(RequestId(request), into) == found
        engine.step()
        assert engine.sched.take_load_errors() == {}
    return found


def files(root: Path) -> int:
    """Shards on the disk: a file per KV head, ``HEADS`` files per rank's shard of a chunk."""
    count = sum(1 for p in (root / "chunks").rglob("*") if p.is_file() and not p.name.startswith("."))
    assert count % HEADS == 0, f"{count} files: not whole shards of {HEADS} heads"
    return count // HEADS


@pytest.mark.parametrize("tp", [1, 2])
def test_hits_come_from_the_pool_then_each_disk_tier_in_turn_byte_for_byte(tmp_path: Path, tp: int) -> None:
    spec = engine_spec(tp)
    a = Engine(load_config(stack(tmp_path, tp)), spec, seed=41)
    try:
        first, second = prompt(41), prompt(42)
        save(a, "first", first)
        assert files(tmp_path / "nvme") == files(tmp_path / "shared") == CHUNKS * tp  # written through
        # every rank's shard reached both disks: the scheduler says so, per tier, once per chunk
        stored = {e.tier: e.keys for e in a.sched.take_events() if e.kind is PoolEventKind.STORED}
        assert sorted(stored) == [0, 1, 2]
        assert stored[1] == stored[2] == stored[0]
        assert len(stored[0]) == CHUNKS
        assert a.sched.stats().tier_stored == (CHUNKS, CHUNKS)
        nvme, shared = a.sched.stats().tier_usage
        assert nvme is not None
        assert shared is not None
        assert nvme.used_bytes == shared.used_bytes > CHUNKS * tp * CHUNK_BYTES  # values and headers
        assert (nvme.capacity_bytes, nvme.evictions) == (64 * 2**20, 0)
        want = [a.blocks(rank, range(CHUNKS * PER_CHUNK)) for rank in range(tp)]
        assert a.sched.stats().tier_found == (0, 0)
        assert load(a, "again", first, at=20) == CHUNKS * CHUNK_TOKENS  # from the pool
        assert a.sched.stats().tier_found == (0, 0)
        save(a, "second", second)  # the pool holds one prompt: the first is pushed out
        assert load(a, "from-nvme", first, at=20) == CHUNKS * CHUNK_TOKENS
        assert a.sched.stats().tier_found == (CHUNKS, 0)
        for rank in range(tp):
            assert a.blocks(rank, range(20, 20 + CHUNKS * PER_CHUNK)) == want[rank]
        save(a, "third", prompt(43))  # pushes the first out of the pool again
        shutil.rmtree(tmp_path / "nvme" / "chunks")  # the first disk lost everything
        assert load(a, "from-shared", first, at=40) == CHUNKS * CHUNK_TOKENS
        assert a.sched.stats().tier_found == (CHUNKS, CHUNKS)
        for rank in range(tp):
            assert a.blocks(rank, range(40, 40 + CHUNKS * PER_CHUNK)) == want[rank]
    finally:
        a.close()


def test_a_new_engine_finds_what_the_last_one_left_in_the_stack(tmp_path: Path) -> None:
    spec = engine_spec(1)
    config = load_config(stack(tmp_path, 1))
    a = Engine(config, spec, seed=51)
    tokens = prompt(51)
    try:
        save(a, "a", tokens)
        want = a.blocks(0, range(CHUNKS * PER_CHUNK))
    finally:
        a.close()
    b = Engine(config, spec, seed=52)  # its pool is empty: every chunk comes from the first disk
    try:
        assert load(b, "b", tokens, at=10) == CHUNKS * CHUNK_TOKENS
        assert b.sched.stats().tier_found == (CHUNKS, 0)
        assert b.blocks(0, range(10, 10 + CHUNKS * PER_CHUNK)) == want
    finally:
        b.close()


def test_a_tier_takes_a_chunk_at_the_save_its_rule_names(tmp_path: Path) -> None:
    spec = engine_spec(1)
    a = Engine(load_config(stack(tmp_path, 1, admit_after=2)), spec, seed=61)
    try:
        tokens = prompt(61)
        save(a, "once", tokens)
        assert (files(tmp_path / "nvme"), files(tmp_path / "shared")) == (0, CHUNKS)
        assert sorted(e.tier for e in a.sched.take_events()) == [0, 2]  # the first disk admitted none
        save(a, "other", prompt(62))  # pushes the first out of the pool
        shutil.rmtree(tmp_path / "shared" / "chunks")  # and the second disk lost it: recomputed, saved again
        save(a, "twice", tokens)
        assert (files(tmp_path / "nvme"), files(tmp_path / "shared")) == (CHUNKS, CHUNKS)
    finally:
        a.close()


def test_a_stack_of_the_pool_and_one_disk_is_the_disk_backend(tmp_path: Path) -> None:
    spec = engine_spec(1)
    (tmp_path / "kv").mkdir()
    disk = {"kind": "disk", "path": str(tmp_path / "kv"), "size": "64MiB"}
    configs = [
        {"chunk_tokens": CHUNK_TOKENS, "backend": {**disk, "local_size": POOL_CHUNKS * CHUNK_BYTES}},
        {"chunk_tokens": CHUNK_TOKENS, "tiers": [{"kind": "cpu", "size": POOL_CHUNKS * CHUNK_BYTES}, disk]},
    ]
    outcomes = []
    for i, config in enumerate(configs):
        shutil.rmtree(tmp_path / "kv" / "chunks", ignore_errors=True)
        engine = Engine(load_config(config), spec, seed=71)
        try:
            save(engine, "first", prompt(71 + i))
            save(engine, "second", prompt(81 + i))
            found = load(engine, "back", prompt(71 + i), at=20)
            outcomes.append((found, files(tmp_path / "kv"), engine.sched.stats().tier_found))
        finally:
            engine.close()
    assert outcomes[0] == outcomes[1] == (CHUNKS * CHUNK_TOKENS, 2 * CHUNKS, (CHUNKS,))


def test_a_stacked_backends_start_up_checks_name_its_place_in_the_stack(tmp_path: Path) -> None:
    config = stack(tmp_path, 1)
    config["tiers"][2]["path"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError) as error:
        open_scheduler(load_config(config), engine_spec(1))
    assert error.value.field == "tiers[2].path"
    assert "an existing directory" in error.value.expected


@pytest.mark.parametrize("tp", [1, 2])
def test_a_disk_written_back_gets_only_the_chunks_the_pool_is_about_to_evict(tmp_path: Path, tp: int) -> None:
    (tmp_path / "kv").mkdir()
    pool_chunks = 4 * CHUNKS  # four prompts; write-back keeps a quarter of the pool free or clean
    config = {
        "chunk_tokens": CHUNK_TOKENS,
        "tiers": [
            {"kind": "cpu", "size": pool_chunks * CHUNK_BYTES * tp},
            {"kind": "disk", "path": str(tmp_path / "kv"), "size": "64MiB", "write": "back"},
        ],
    }
    spec = engine_spec(tp)
    a = Engine(load_config(config), spec, seed=91)
    prompts = [prompt(91 + i) for i in range(5)]
    try:
        for i in range(3):
            save(a, f"p{i}", prompts[i])
        a.step()
        assert files(tmp_path / "kv") == 0  # the pool has room: nothing written yet
        assert a.sched.stats().pool.dirty == 3 * CHUNKS
        want = [a.blocks(rank, range(CHUNKS * PER_CHUNK)) for rank in range(tp)]  # p3 overwrites them
        save(a, "p3", prompts[3])  # fills the pool: its step writes the least recently used back, p0's
        stats = a.sched.stats()
        assert (stats.written_back_chunks, stats.failed_write_back_chunks, stats.pool.dirty) == (
            CHUNKS,
            0,
            3 * CHUNKS,
        )
        assert files(tmp_path / "kv") == CHUNKS * tp
        save(a, "p4", prompts[4])  # evicts p0, written back and clean, never a dirty chunk; writes p1 back
        assert a.sched.stats().written_back_chunks == 2 * CHUNKS
        assert load(a, "p0-again", prompts[0], at=20) == CHUNKS * CHUNK_TOKENS  # from the disk
        assert a.sched.stats().tier_found == (CHUNKS,)
        for rank in range(tp):
            assert a.blocks(rank, range(20, 20 + CHUNKS * PER_CHUNK)) == want[rank]
        for i in (2, 3, 4):  # still in the pool: hits from the pool
            assert load(a, f"p{i}-again", prompts[i], at=40) == CHUNKS * CHUNK_TOKENS
        assert a.sched.stats().tier_found == (CHUNKS,)
        # p0's promotion into the pool evicted p1 (clean): the next step wrote p2 back
        assert a.sched.stats().written_back_chunks == 3 * CHUNKS
        assert a.sched.stats().tier_stored == (3 * CHUNKS,)
    finally:
        a.close()
    # closing wrote back what was still dirty (p3's and p4's): a restart finds every prompt on the disk
    assert files(tmp_path / "kv") == 5 * CHUNKS * tp
    b = Engine(load_config(config), spec, seed=92)
    try:
        assert [load(b, f"b{i}", prompts[i], at=10) for i in range(5)] == [CHUNKS * CHUNK_TOKENS] * 5
        assert b.sched.stats().tier_found == (5 * CHUNKS,)
    finally:
        b.close()


def test_a_stack_writes_through_and_back_per_tier(tmp_path: Path) -> None:
    config = stack(tmp_path, 1)
    config["tiers"][1]["write"] = "back"
    config["tiers"][0]["size"] = 4 * CHUNKS * CHUNK_BYTES
    a = Engine(load_config(config), engine_spec(1), seed=93)
    try:
        for i in range(3):
            save(a, f"p{i}", prompt(93 + i))
            assert (files(tmp_path / "nvme"), files(tmp_path / "shared")) == (0, (i + 1) * CHUNKS)
        save(a, "p3", prompt(96))  # fills the pool: its step writes the least recently used back
        assert (files(tmp_path / "nvme"), files(tmp_path / "shared")) == (CHUNKS, 4 * CHUNKS)
    finally:
        a.close()


@pytest.mark.parametrize("damaged", [1, 2])
def test_a_damaged_chunk_file_costs_its_chunk_and_what_follows_never_what_came_before(
    tmp_path: Path, damaged: int
) -> None:
    spec = engine_spec(1)
    (tmp_path / "kv").mkdir()
    config = load_config(
        {
            "chunk_tokens": CHUNK_TOKENS,
            "backend": {"kind": "disk", "path": str(tmp_path / "kv"), "size": "64MiB", "local_size": "1MiB"},
        }
    )
    tokens = prompt(81)
    a = Engine(config, spec, seed=81)
    try:
        save(a, "first", tokens)
        saved = a.blocks(0, range(CHUNKS * PER_CHUNK))
        chain = a.sched.keyer.chain(ExtraKeys(), tokens, None, None)
    finally:
        a.close()
    (key,) = chain.rank_keys[damaged]
    directory = ChunkDirectory.open(tmp_path / "kv", 64 * 2**20)
    path = directory.path(head_keys(key)[-1])  # one head's file
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte of the value: its digest no longer matches
    path.write_bytes(bytes(data))
    b = Engine(config, spec, seed=82)  # a new engine: an empty pool, the files on disk
    try:
        assert b.lookup("again", tokens) == CHUNKS * CHUNK_TOKENS
        into = list(range(20, 20 + len(tokens) // BLOCK + 1))
        b.sched.start_load(RequestId("again"), into)
        b.step()
        errors = b.sched.take_load_errors()[RequestId("again")]
        lost = into[damaged * PER_CHUNK : (damaged + 1) * PER_CHUNK]
        assert set(lost) <= set(errors) <= set(into[damaged * PER_CHUNK :])  # from the damaged chunk on
        served = damaged * PER_CHUNK
        assert b.sched.extra_cached_tokens(RequestId("again")) == served * BLOCK
        assert b.blocks(0, range(20, 20 + served)) == saved[:served]  # the intact chunks, byte for byte
        deadline = time.monotonic() + SETTLE_S
        while path.exists():  # the damaged file goes (behind the saves): the next lookup stops before it
            assert time.monotonic() < deadline, "the damaged file was never removed"
            time.sleep(0.01)
        assert b.lookup("third", tokens) == damaged * CHUNK_TOKENS
    finally:
        b.close()
