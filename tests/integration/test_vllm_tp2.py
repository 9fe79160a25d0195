"""kvcore's CPU tier in a real vLLM engine at tensor-parallel size 2 (CPU build, tiny models).

One engine per model, each running ``tests.integration.tp2.reuse_flow`` once: one KV head (replicated:
both ranks hold the same head and the same bytes) and four KV heads (two on each rank). Each rank has
its own host pool holding its shard; one scheduler indexes both, and an op completes only when both
ranks reported it. The prompt, evicted from vLLM's cache, comes back from kvcore with the tokens of
vLLM's own prefix hit on the same engine, and each rank's loaded blocks are the bytes it saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import BLOCK, VLLM_MARKS, stop_engine
from tests.integration.tp2 import (
    CHUNK_BLOCKS,
    EXPECTED_SAVED_CHUNKS,
    GAUGES,
    HEAD_COUNTS,
    PROMPT_CHUNKS,
    TP,
    ReuseRun,
    check_bytes,
    check_reuse,
    host_digests_probe,
    kv_heads_model,
    reuse_flow,
    start_tp_engine,
    tier_config,
)

pytestmark = VLLM_MARKS


@pytest.fixture(scope="module", params=HEAD_COUNTS, ids=lambda heads: f"kv_heads={heads}")
def run(request: pytest.FixtureRequest, vllm_env: Path) -> ReuseRun:
    heads: int = request.param
    llm = start_tp_engine(kv_heads_model(vllm_env, heads), heads, tier_config())
    try:
        return reuse_flow(llm, heads, host_digests_probe, seed=8800 + heads)
    finally:
        stop_engine(llm)


def test_evicted_prompt_is_served_with_the_tokens_of_vllms_own_hit(run: ReuseRun) -> None:
    check_reuse(run)


def test_each_rank_loads_the_bytes_it_saved(run: ReuseRun) -> None:
    check_bytes(run, writers=tuple(range(TP)))  # every rank keeps its own shard in its own pool
    for load in run.loads:  # served from the pool, where it stayed
        assert set(load.digests) <= run.resident[load.rank]


def test_every_rank_reported_every_op(run: ReuseRun) -> None:
    # an op is done once both ranks reported it: counted once per engine, nothing left pinned or in flight
    assert run.gauges == dict.fromkeys(GAUGES, 0.0)
    assert run.counters == {
        "hit_tokens": PROMPT_CHUNKS * CHUNK_BLOCKS * BLOCK,
        "loaded_blocks": PROMPT_CHUNKS * CHUNK_BLOCKS,
        "async_loads": 0,  # from the host pool: synchronous
        "saved_blocks": EXPECTED_SAVED_CHUNKS * CHUNK_BLOCKS,
        "failed_load_blocks": 0,
        "failed_save_chunks": 0,
    }
