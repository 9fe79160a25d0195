"""A prompt's tail (its whole blocks after the last whole chunk) through a real Mooncake store: engine A
saves its chunks and its tail, each a value of its own blocks; engine B, whose pool holds nothing, finds
them all in one lookup and loads every byte, the tail's block included (engines stepped by hand, each a
scheduler and its ranks' workers with a host pool in front of the store)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.config import load_config
from kvcore.ids import RequestId
from tests.hand_engine import BLOCK, CHUNK_TOKENS, CHUNKS, PER_CHUNK, Engine, engine_spec, prompt, save
from tests.mooncake.conftest import Master, MasterFactory


def _engine(master: Master, spec: Any, seed: int, segment: str) -> Engine:
    backend = {
        "kind": "mooncake_store",
        "master": master.address,
        "local_size": "4MiB",
        "segment_size": segment,
        "transfer_buffer_size": "16MiB",
    }
    return Engine(load_config({"chunk_tokens": CHUNK_TOKENS, "backend": backend}), spec, seed)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_prompts_tail_is_stored_and_loaded_through_the_store_byte_for_byte(
    tp: int, master_factory: MasterFactory
) -> None:
    master = master_factory()  # of its own: the shared one may still place values in a gone client's segment
    spec = engine_spec(tp)
    a = _engine(master, spec, 31, "64MiB")  # the store's memory lives in engine A's segment
    b = _engine(master, spec, 32, "0")
    try:
        tokens = prompt(31, tail_blocks=2)
        save(a, "a", tokens)
        (op,) = a.plans[-1].ops
        assert [c.value_blocks for c in op.remote] == [None] * CHUNKS + [2]
        cached = CHUNKS * CHUNK_TOKENS + 2 * BLOCK
        assert b.lookup("b", tokens) == cached  # every chunk and the tail, from the store
        into = list(range(30, 30 + (CHUNKS + 1) * PER_CHUNK))
        assert b.sched.start_load(RequestId("b"), into) == cached
        b.step()
        assert b.sched.take_load_errors() == {}
        loaded = CHUNKS * PER_CHUNK + 2
        for rank in range(tp):
            assert b.blocks(rank, range(30, 30 + loaded)) == a.blocks(rank, range(loaded))
        # a block less is another tail, in no tier: the chunks are found, not the tail
        assert b.lookup("c", prompt(31, tail_blocks=1)) == CHUNKS * CHUNK_TOKENS
        # a block more: the store has no such tail, B's pool the one it fetched, a prefix of it
        assert b.lookup("d", prompt(31, tail_blocks=3)) == cached
    finally:
        b.close()
        a.close()
