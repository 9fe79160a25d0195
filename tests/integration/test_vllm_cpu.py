"""kvcore inside a real vLLM engine (CPU build, tiny model): tokens, external hits and KV bytes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import BLOCK, PROMPTS, generate, prompt

pytestmark = pytest.mark.timeout(600)


def _external_hits(llm: Any) -> int:
    for metric in llm.get_metrics():
        if metric.name == "vllm:external_prefix_cache_hits":
            return int(metric.value)
    return 0


def _loaded_equals_saved(worker: Any) -> tuple[int, bool]:
    """Runs in the worker process: the last loaded engine blocks against the host blocks they came from."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group().worker_side
    engine_blocks, host_blocks = side.last_load
    tier = side.worker
    same = all(
        tier.engine_block_bytes(e) == tier.host_block_bytes(h)
        for e, h in zip(engine_blocks, host_blocks, strict=True)
    )
    return len(engine_blocks), same


def test_no_hits_same_tokens_as_without_connector(
    plain_tokens: dict[str, list[int]], kvcore_engine: Any
) -> None:
    for name, tokens in PROMPTS.items():
        out = generate(kvcore_engine, tokens)
        assert list(out.outputs[0].token_ids) == plain_tokens[name], name


def test_external_hit_after_eviction_matches_local_hit(kvcore_engine: Any) -> None:
    tokens = prompt(100, 4 * BLOCK + 60)
    first = generate(kvcore_engine, tokens)
    local = generate(kvcore_engine, tokens)  # vLLM's own prefix hit
    assert local.num_cached_tokens == 4 * BLOCK
    hits_before = _external_hits(kvcore_engine)
    for seed in range(3):  # push the prompt out of vLLM's 24-block cache
        generate(kvcore_engine, prompt(200 + seed, 1500), max_tokens=1)
    again = generate(kvcore_engine, tokens, kv_transfer_params={"num_extra_cached_tokens": True})
    assert again.num_cached_tokens == 4 * BLOCK
    assert _external_hits(kvcore_engine) - hits_before == 4 * BLOCK
    assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)
    assert again.kv_transfer_params == {"num_extra_cached_tokens": 4 * BLOCK}
    assert first.num_cached_tokens == 0
    ((blocks, same),) = kvcore_engine.collective_rpc(_loaded_equals_saved)
    assert blocks == 4
    assert same
