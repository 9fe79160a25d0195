"""A disk tier shared by engines of different tensor-parallel sizes (stepped by hand, real workers, host
pools and disk tiers): a chunk written at one TP size is served at any other the model's four KV heads
allow (split, and replicated at TP 8), every head of every layer the writer's bytes; and a pool written
back to the disk when its engine stops serves the engine that replaces it at another TP size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcore.config import load_config
from kvcore.ids import RequestId
from tests.cross_tp import KV_HEADS, LAYERS, cross_tp, heads_of, spec
from tests.hand_engine import CHUNK_TOKENS, CHUNKS, PER_CHUNK, Engine, prompt, save

SLOT_BYTES = CHUNK_TOKENS * LAYERS * 2 * 16 * 2 * KV_HEADS  # a chunk of every head: a TP-1 rank's slot


def disk(tmp_path: Path, **tier: Any) -> dict[str, Any]:
    return {
        "chunk_tokens": CHUNK_TOKENS,
        "tiers": [
            {"kind": "cpu", "size": 2 * CHUNKS * SLOT_BYTES},
            {"kind": "disk", "path": str(tmp_path), "size": "64MiB", **tier},
        ],
    }


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (1, 4), (4, 2), (2, 8), (8, 1)])
def test_a_chunk_written_at_one_tp_size_is_read_at_another(
    tmp_path: Path, writer_tp: int, reader_tp: int
) -> None:
    writer, reader = cross_tp(
        load_config(disk(tmp_path)), writer_tp, reader_tp, seed=writer_tp * 10 + reader_tp
    )
    try:
        files = [p for p in (tmp_path / "chunks").rglob("*") if p.is_file() and not p.name.startswith(".")]
        assert len(files) == CHUNKS * KV_HEADS  # one file per head of each chunk, whoever wrote it
        assert reader.sched.stats().tier_found == (CHUNKS,)
    finally:
        writer.close()
        reader.close()


def test_a_pool_written_back_at_tp_1_serves_its_replacement_at_tp_2(tmp_path: Path) -> None:
    config = load_config(disk(tmp_path, write="back"))
    tokens = prompt(77)
    writer = Engine(config, spec(1, "org/restarted"), seed=77)
    try:
        save(writer, "first", tokens)
        want = heads_of(writer, range(CHUNKS * PER_CHUNK), loaded=False)
    finally:
        writer.close()  # the pool's chunks, dirty, are written back now
    reader = Engine(config, spec(2, "org/restarted"), seed=78)
    try:
        assert reader.lookup("again", tokens) == CHUNKS * CHUNK_TOKENS
        into = list(range(20, 20 + CHUNKS * PER_CHUNK))
        assert reader.sched.start_load(RequestId("again"), into) == CHUNKS * CHUNK_TOKENS
        reader.step()
        assert reader.sched.take_load_errors() == {}
        assert heads_of(reader, range(20, 20 + CHUNKS * PER_CHUNK), loaded=True) == want
        assert len(want) == CHUNKS * PER_CHUNK * LAYERS * KV_HEADS
    finally:
        reader.close()
