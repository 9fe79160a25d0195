"""kvcore inside a real vLLM engine (CPU build, tiny model): tokens, external hits and KV bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.integration.conftest import (
    BLOCK,
    PROMPTS,
    VLLM_MARKS,
    generate,
    kvcore_transfer_config,
    prompt,
    reset_cache,
    start_engine,
    stop_engine,
)
from tests.integration.probes import damage_pool, engine_metrics, external_hits, kvcore_metric, loaded_digests

pytestmark = VLLM_MARKS


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
    hits_before = external_hits(kvcore_engine)
    for seed in range(3):  # push the prompt out of vLLM's 24-block cache
        generate(kvcore_engine, prompt(200 + seed, 1500), max_tokens=1)
    again = generate(kvcore_engine, tokens, kv_transfer_params={"num_extra_cached_tokens": True})
    assert again.num_cached_tokens == 4 * BLOCK
    assert external_hits(kvcore_engine) - hits_before == 4 * BLOCK
    assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)
    assert again.kv_transfer_params == {"num_extra_cached_tokens": 4 * BLOCK}
    assert first.num_cached_tokens == 0
    ((digests, same),) = kvcore_engine.collective_rpc(loaded_digests)
    assert len(digests) == 4
    assert same


def test_a_whole_prompt_hit_loads_all_but_the_last_token(kvcore_engine: Any) -> None:
    # a prompt of whole chunks, all of them in the pool: kvcore loads 4 * BLOCK - 1 tokens, the last block
    # partly, and vLLM computes one token; then vLLM's own cache serves that block once it is full
    tokens, longer = prompt(150, 4 * BLOCK), prompt(150, 4 * BLOCK) + prompt(151, 40)
    assert reset_cache(kvcore_engine, reset_connector=True)
    recomputed_longer = generate(kvcore_engine, longer)
    assert reset_cache(kvcore_engine, reset_connector=True)
    recomputed = generate(kvcore_engine, tokens)
    assert recomputed.num_cached_tokens == 0
    for seed in range(3):  # push the prompt out of vLLM's 24-block cache
        generate(kvcore_engine, prompt(250 + seed, 1500), max_tokens=1)
    hits_before = external_hits(kvcore_engine)
    again = generate(kvcore_engine, tokens, kv_transfer_params={"num_extra_cached_tokens": True})
    assert again.num_cached_tokens == 4 * BLOCK - 1
    assert external_hits(kvcore_engine) - hits_before == 4 * BLOCK - 1
    assert again.kv_transfer_params == {"num_extra_cached_tokens": 4 * BLOCK - 1}
    assert list(again.outputs[0].token_ids) == list(recomputed.outputs[0].token_ids)
    ((digests, same),) = kvcore_engine.collective_rpc(loaded_digests)
    assert len(digests) == 4
    assert same
    # the partly loaded block, completed by vLLM's one computed token, is now vLLM's own whole-block hit
    served = generate(kvcore_engine, longer)
    assert served.num_cached_tokens == 4 * BLOCK
    assert list(served.outputs[0].token_ids) == list(recomputed_longer.outputs[0].token_ids)


def _push_out(llm: Any, seed: int) -> None:
    """Evict everything from vLLM's 24-block prefix cache."""
    for i in range(3):
        generate(llm, prompt(seed + i, 1500), max_tokens=1)


def _answer(llm: Any, tokens: list[int], max_tokens: int) -> list[int]:
    """``max_tokens`` greedy tokens, never fewer (the tiny model may well sample its end token)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def test_a_prompt_ending_inside_a_chunk_loads_its_last_whole_block_too(kvcore_engine: Any) -> None:
    # two chunks of two blocks, then one whole block and 60 tokens: the tail of that block is kept
    tokens = prompt(170, 5 * BLOCK + 60)
    generate(kvcore_engine, tokens)
    local = generate(kvcore_engine, tokens)  # vLLM's own prefix hit
    assert local.num_cached_tokens == 5 * BLOCK
    _push_out(kvcore_engine, 270)
    hits_before = external_hits(kvcore_engine)
    again = generate(kvcore_engine, tokens, kv_transfer_params={"num_extra_cached_tokens": True})
    assert again.num_cached_tokens == 5 * BLOCK  # not 4 * BLOCK: the chunk's first block is served
    assert external_hits(kvcore_engine) - hits_before == 5 * BLOCK
    assert again.kv_transfer_params == {"num_extra_cached_tokens": 5 * BLOCK}
    assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)
    ((digests, same),) = kvcore_engine.collective_rpc(loaded_digests)
    assert len(digests) == 5
    assert same


def test_the_next_turn_loads_the_last_whole_block_the_turn_before_computed(kvcore_engine: Any) -> None:
    # the first turn ends inside its third chunk, past one whole block of it: that tail is kept at finish
    first = prompt(180, 4 * BLOCK + 100)
    turn2 = first + _answer(kvcore_engine, first, 40) + prompt(181, 30)
    _push_out(kvcore_engine, 280)
    hits_before = external_hits(kvcore_engine)
    again = generate(kvcore_engine, turn2)
    assert again.num_cached_tokens == 5 * BLOCK
    assert external_hits(kvcore_engine) - hits_before == 5 * BLOCK
    ((digests, same),) = kvcore_engine.collective_rpc(loaded_digests)
    assert len(digests) == 5
    assert same
    # vLLM's own hit of the same length: the first turn again, from an empty cache, then the second
    assert reset_cache(kvcore_engine, reset_connector=True)
    _answer(kvcore_engine, first, 40)
    local = generate(kvcore_engine, turn2)
    assert local.num_cached_tokens == 5 * BLOCK
    assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)


def _evicted_and_served_again(llm: Any, tokens: list[int], seed: int) -> tuple[Any, Any]:
    """Serve ``tokens`` (saving their KV), push them out of vLLM's cache, damage the pool, serve again."""
    first = generate(llm, tokens)
    for i in range(3):
        generate(llm, prompt(seed + i, 1500), max_tokens=1)
    assert llm.collective_rpc(damage_pool) == [True]
    return first, generate(llm, tokens, max_tokens=16)


def test_loaded_kv_is_really_used(kvcore_engine: Any) -> None:
    # damaged KV in the pool, no checksums: the engine loads it and its output changes
    tokens = prompt(700, 4 * BLOCK + 10)
    reference = generate(kvcore_engine, tokens, max_tokens=16)
    _, damaged = _evicted_and_served_again(kvcore_engine, tokens, 710)
    assert damaged.num_cached_tokens == 4 * BLOCK
    assert list(damaged.outputs[0].token_ids) != list(reference.outputs[0].token_ids)


def test_preemption_and_reset_leak_nothing(kvcore_engine: Any) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # four long requests at once in a 24-block engine: vLLM must preempt some of them mid-flight
    prompts = [TokensPrompt(prompt_token_ids=prompt(300 + i, 900)) for i in range(4)]
    outs = kvcore_engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    assert reset_cache(kvcore_engine, reset_connector=True)
    # gauges are sampled at the end of each step: a few short requests (no full chunk, so nothing of
    # their own to save) let the last reports of the long ones arrive
    gauges = ("pool_pinned", "pool_storing", "ops_in_flight", "requests")
    for seed in range(5):
        generate(kvcore_engine, prompt(400 + seed, BLOCK - 20), max_tokens=1)
        values = {name: kvcore_metric(kvcore_engine, name) for name in gauges}
        if not any(values.values()):
            break
    assert values == dict.fromkeys(gauges, 0.0)


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
"""Speculative decoding by n-gram lookup (no draft model): vLLM then calls ``wait_for_save`` after
``get_finished`` in each step (``defer_finalize``)."""


def test_checksums_turn_damage_into_recompute_under_speculative_decoding(tiny_model: Path) -> None:
    # its own engine, started last: vLLM re-registers its Prometheus metrics per engine, and the test
    # process reads them from one registry. Speculative decoding reorders the connector's calls of a step
    # (finished requests asked for before the step's saves are submitted): the saves must still store the
    # request's KV, which the checksummed reload after eviction serves with the reference's tokens
    llm = start_engine(tiny_model, kvcore_transfer_config(checksums=True), speculative_config=NGRAM)
    try:
        tokens = prompt(800, 4 * BLOCK + 10)
        reference = generate(llm, tokens, max_tokens=16)
        served, again = _evicted_and_served_again(llm, tokens, 810)
        assert served.num_cached_tokens == 4 * BLOCK
        assert kvcore_metric(llm, "failed_load_blocks") == 4
        assert list(again.outputs[0].token_ids) == list(reference.outputs[0].token_ids)
        undamaged = prompt(820, 4 * BLOCK + 10)
        first = generate(llm, undamaged, max_tokens=16)
        for i in range(3):
            generate(llm, prompt(830 + i, 1500), max_tokens=1)
        reused = generate(llm, undamaged, max_tokens=16)
        assert reused.num_cached_tokens == 4 * BLOCK
        assert list(reused.outputs[0].token_ids) == list(first.outputs[0].token_ids)
        assert kvcore_metric(llm, "failed_load_blocks") == 4  # nothing more failed its digest
        assert kvcore_metric(llm, "pool_pinned") == 0
        assert any(m.name == "vllm:spec_decode_num_drafts" and m.value > 0 for m in engine_metrics(llm))
    finally:
        stop_engine(llm)
