"""Three tiers on a real Mooncake store: a CPU pool too small for the workload, a local disk tier, and the
Mooncake store shared by engines (engines stepped by hand, each a scheduler and its ranks' workers).
Hits come from each tier in turn, byte for byte; an engine whose disk is empty finds another engine's
chunks in the store."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kvcore.config import load_config
from kvcore.ids import RequestId
from kvcore.model.engine import EngineSpec
from tests.hand_engine import CHUNK_TOKENS, CHUNKS, PER_CHUNK, Engine, engine_spec, prompt, save
from tests.mooncake.conftest import Master, MasterFactory

CHUNK_BYTES = 32 * 1024  # per rank: 2 layers x K,V x 2 heads x 128 tokens x 16 x bf16


def _engine(master: Master, spec: EngineSpec, disk: Path, seed: int, segment: str) -> Engine:
    disk.mkdir(exist_ok=True)
    config: dict[str, Any] = {
        "chunk_tokens": CHUNK_TOKENS,
        "tiers": [
            {"kind": "cpu", "size": CHUNKS * CHUNK_BYTES},  # one prompt: the next pushes it out
            {"kind": "disk", "path": str(disk), "size": "64MiB"},
            {
                "kind": "mooncake_store",
                "master": master.address,
                "segment_size": segment,
                "transfer_buffer_size": "16MiB",
            },
        ],
    }
    return Engine(load_config(config), spec, seed)


def _load(engine: Engine, request: str, tokens: list[int], at: int) -> int:
    found = engine.lookup(request, tokens)
    assert engine.sched.start_load(RequestId(request), list(range(at, at + CHUNKS * PER_CHUNK + 1))) == found
    engine.step()
    assert engine.sched.take_load_errors() == {}
    return found


def test_hits_come_from_the_pool_the_disk_and_the_store_in_turn(
    master_factory: MasterFactory, tmp_path: Path
) -> None:
    master = master_factory()  # of its own: no other test's values in the store
    spec = engine_spec(1)  # one model: the engines share keys
    a = _engine(master, spec, tmp_path / "a", 91, "64MiB")  # the store's memory lives in A's segment
    b = _engine(master, spec, tmp_path / "b", 92, "0")
    try:
        first = prompt(91)
        whole = CHUNKS * CHUNK_TOKENS
        save(a, "first", first)
        want = a.blocks(0, range(CHUNKS * PER_CHUNK))
        assert _load(a, "pool", first, at=20) == whole
        assert a.sched.stats().tier_found == (0, 0)
        save(a, "second", prompt(92))  # pushes the first out of the pool
        assert _load(a, "disk", first, at=20) == whole
        assert a.sched.stats().tier_found == (CHUNKS, 0)
        assert a.blocks(0, range(20, 20 + CHUNKS * PER_CHUNK)) == want
        save(a, "third", prompt(93))  # out of the pool again, and the disk loses everything
        shutil.rmtree(tmp_path / "a" / "chunks")
        assert _load(a, "store", first, at=40) == whole
        assert a.sched.stats().tier_found == (CHUNKS, CHUNKS)
        assert a.blocks(0, range(40, 40 + CHUNKS * PER_CHUNK)) == want
        # engine B's pool and disk are empty: the store has A's chunks
        assert _load(b, "other", first, at=10) == whole
        assert b.sched.stats().tier_found == (0, CHUNKS)
        assert b.blocks(0, range(10, 10 + CHUNKS * PER_CHUNK)) == want
    finally:
        b.close()
        a.close()
