"""kvcore on a Mooncake store in a real vLLM engine at tensor-parallel size 2 (CPU build, tiny models).

One engine per model, each on a master and a segment holder of its own (so every key in the store is
that engine's), running ``tests.integration.tp2.reuse_flow`` once. Each rank has a small local pool in
front of the store: the prompt evicted from vLLM's cache has left both ranks' pools too (checked out of
band), so it comes back from the store. With one KV head (replicated) rank 0 alone writes the shared key
and both ranks read it; with four (two per rank) each rank writes and reads the keys of its two heads
(the store keeps one value per KV head).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from attrs import frozen

from tests.integration.conftest import (  # the shared vLLM fixtures and helpers
    BLOCK,
    VLLM_MARKS,
    stop_engine,
    tiny_model,
    vllm_env,
)
from tests.integration.tp2 import (
    CHUNK_BLOCKS,
    EXPECTED_SAVED_CHUNKS,
    GAUGES,
    HEAD_COUNTS,
    LAYERS,
    PROMPT_CHUNKS,
    TP,
    ReuseRun,
    check_bytes,
    check_reuse,
    host_digests_probe,
    kv_heads_model,
    reuse_flow,
    slot_bytes,
    start_tp_engine,
    tier_config,
)
from tests.mooncake.conftest import Masters, own_store, stored_keys

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS

POOL_SLOTS = 8  # chunks per rank in the local pool: fewer than the evicting prompts save


@frozen
class StoreRun:
    run: ReuseRun
    keys: tuple[str, ...]  # every key in the store (the master's list) after the flow


@pytest.fixture(scope="module", params=HEAD_COUNTS, ids=lambda heads: f"kv_heads={heads}")
def store_run(request: pytest.FixtureRequest, vllm_env: Path, _masters: Masters) -> StoreRun:
    heads: int = request.param
    with own_store(_masters) as master:  # the engine's own: every key in it is this engine's
        backend = {
            "kind": "mooncake_store",
            "master": master.address,
            "segment_size": 0,
            "local_size": POOL_SLOTS * TP * slot_bytes(heads),  # the total over both ranks
        }
        llm = start_tp_engine(kv_heads_model(vllm_env, heads), heads, tier_config(backend))
        try:
            run = reuse_flow(llm, heads, host_digests_probe, seed=8900 + heads)
        finally:
            stop_engine(llm)
        return StoreRun(run, stored_keys(master))


def test_evicted_prompt_is_served_from_the_store_with_the_tokens_of_vllms_own_hit(
    store_run: StoreRun,
) -> None:
    check_reuse(store_run.run)


def test_each_rank_loads_its_shard_from_the_store(store_run: StoreRun) -> None:
    run = store_run.run
    # with one head, rank 1 reads the key rank 0 wrote (and holds the same bytes itself)
    check_bytes(run, writers=(0, 0) if run.kv_heads < TP else (0, 1))
    for load in run.loads:  # neither rank's pool held the prompt any more: the bytes came from the store
        assert not set(load.digests) & run.resident[load.rank], f"rank {load.rank} loaded from its pool"
        assert load.host_blocks, "a load from the store stages through the pool"


def test_keys_are_one_per_kv_head(store_run: StoreRun) -> None:
    run = store_run.run
    by_shard: dict[str, set[str]] = defaultdict(set)
    namespaces = set()
    for key in store_run.keys:
        kind, namespace, shard, chunk = key.split("/")
        assert kind == "kv", key
        namespaces.add(namespace)
        by_shard[shard].add(chunk)
    assert len(namespaces) == 1, namespaces
    # one value per KV head, whichever rank wrote it (with one head, rank 0 alone: its replica does not)
    assert sorted(by_shard) == [f"l0-{LAYERS}.h{h}-{h + 1}.c0.g0" for h in range(run.kv_heads)]
    chunks = list(by_shard.values())
    assert all(shard == chunks[0] for shard in chunks)  # every head of every chunk was published
    assert len(chunks[0]) == EXPECTED_SAVED_CHUNKS
    assert len(store_run.keys) == run.kv_heads * EXPECTED_SAVED_CHUNKS


def test_every_rank_reported_every_op(store_run: StoreRun) -> None:
    run = store_run.run
    assert run.gauges == dict.fromkeys(GAUGES, 0.0)
    assert run.counters == {
        "hit_tokens": PROMPT_CHUNKS * CHUNK_BLOCKS * BLOCK,
        "loaded_blocks": PROMPT_CHUNKS * CHUNK_BLOCKS,
        "async_loads": 1,  # from the store: the request waited alone
        "saved_blocks": EXPECTED_SAVED_CHUNKS * CHUNK_BLOCKS,
        "failed_load_blocks": 0,
        "failed_save_chunks": 0,
    }
