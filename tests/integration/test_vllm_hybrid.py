"""A hybrid model (Gemma-3 style: sliding-window and full attention layers, made locally) through kvcore on
a real vLLM CPU engine, with vLLM's hybrid KV-cache manager on.

vLLM keeps the model as two KV-cache groups: the sliding-window layers, whose blocks outside the window
of 200 tokens are given back (vLLM's null block), and the full attention layers. kvcore serves each group
under its own keys; a hit is one both groups serve. A prompt pushed out of vLLM's cache comes back from
kvcore with the greedy tokens of vLLM's own prefix hit of the same length; the sliding-window group loads
only the blocks of the hit's last window, and every loaded block holds exactly the bytes kvcore saved.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore_cli.tiny_model import HYBRID_WINDOW, make_tiny_hybrid_model
from tests.integration.conftest import (
    BLOCK,
    VLLM_MARKS,
    generate,
    kvcore_transfer_config,
    prompt,
    reset_cache,
    start_engine,
    stop_engine,
)
from tests.integration.probes import external_hits, group_loads, group_sides, kvcore_metric
from tests.integration.tp2 import engine_env

pytestmark = [*VLLM_MARKS, pytest.mark.slow]

CHUNK = BLOCK
# bf16 K and V of 2 heads of 64 per token and layer; 2 layers per group, 2 groups
TOKEN_BYTES = 2 * 2 * 64 * 2 * 2 * 2
ENGINE_BLOCKS = 24  # per group: vLLM must evict its own prefix cache
SWA_GROUP, FULL_GROUP = 0, 1  # vLLM's group order for layer_types [S, F, S, F]


def start_hybrid_engine(model: Path, kv_transfer_config: dict[str, Any], tp: int = 1) -> Any:
    """A TP-``tp`` vLLM engine on the hybrid model, with ``ENGINE_BLOCKS`` blocks of each group (a rank
    holds ``1 / tp`` of the KV heads)."""
    with engine_env(tp):
        return start_engine(
            model,
            kv_transfer_config,
            kv_cache_memory_bytes=ENGINE_BLOCKS * BLOCK * TOKEN_BYTES // tp,
            tensor_parallel_size=tp,
        )


@pytest.fixture(scope="module")
def hybrid_engine(vllm_env: Path) -> Iterator[Any]:
    config = kvcore_transfer_config(backend={"kind": "cpu", "size": "64MiB"}, chunk_tokens=CHUNK)
    llm = start_hybrid_engine(make_tiny_hybrid_model(vllm_env / "tiny-hybrid"), config)
    yield llm
    stop_engine(llm)


def window_blocks(hit: int) -> int:
    """Blocks of the sliding-window group a hit of ``hit`` tokens loads: those of its last window."""
    return hit // BLOCK - max(hit - HYBRID_WINDOW, 0) // BLOCK


def push_out(llm: Any) -> None:
    """Serve prompts that take more than all of vLLM's blocks, evicting its own prefix cache (a
    1500-token prompt holds 12 blocks of the full attention group and 3 of the sliding-window one)."""
    for seed in range(5):
        generate(llm, prompt(100 + seed, 1500), max_tokens=1)


def test_vllm_keeps_its_hybrid_manager_with_kvcore(hybrid_engine: Any) -> None:
    config = hybrid_engine.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    generate(hybrid_engine, prompt(3, 50), max_tokens=1)  # the gauges are published with a step
    # the two groups share the 64 MiB: a chunk of each per slot pair
    assert kvcore_metric(hybrid_engine, "pool_capacity") == 2 * (64 << 20) // (CHUNK * TOKEN_BYTES)


@pytest.mark.parametrize("length", [1000, 150])
def test_a_hybrid_prompt_comes_back_from_kvcore_as_from_vllms_own_prefix_hit(
    hybrid_engine: Any, length: int
) -> None:
    # served, served again from vLLM's own prefix cache, pushed out, served from kvcore: the same hit
    # length and the same greedy tokens as vLLM's own hit
    tokens = prompt(length, length)
    generate(hybrid_engine, tokens)
    own = generate(hybrid_engine, tokens)
    expected = (length - 1) // BLOCK * BLOCK
    assert own.num_cached_tokens == expected
    push_out(hybrid_engine)
    before = external_hits(hybrid_engine)
    reused = generate(hybrid_engine, tokens)
    assert external_hits(hybrid_engine) - before == expected
    assert reused.num_cached_tokens == expected
    assert list(reused.outputs[0].token_ids) == list(own.outputs[0].token_ids)
    if not expected:
        return
    ((swa, full),) = hybrid_engine.collective_rpc(group_loads)
    for digests, same, _ in (swa, full):
        assert same  # every loaded block holds the bytes of the slot it was loaded from
        assert len(set(digests)) == len(digests)  # and each the KV of its own tokens
    full_blocks = len(full[0])
    assert full_blocks == expected // BLOCK
    # the sliding-window group loads the blocks of the hit's last window only: those holding tokens
    # [expected - window, expected)
    assert len(swa[0]) == window_blocks(expected)
    assert len(swa[0]) < full_blocks or expected <= HYBRID_WINDOW + BLOCK
    assert swa[2] == full[2] == BLOCK * TOKEN_BYTES // 2  # one group's block: its two layers


def test_a_turn_that_extends_a_hybrid_conversation_reuses_its_decoded_blocks(hybrid_engine: Any) -> None:
    # the first turn decodes 150 tokens past its 500-token prompt: the chunk [512, 640) is computed token
    # by token while the sliding window moves on, and saved once full. Pushed out of vLLM's cache, the
    # next turn (5 tokens more) loads it from kvcore, then gets the same hit from vLLM's own cache: the
    # same greedy tokens
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    first = prompt(7, 500)
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    (out,) = hybrid_engine.generate([TokensPrompt(prompt_token_ids=first)], params, use_tqdm=False)
    second = [*first, *out.outputs[0].token_ids, *prompt(8, 5)]
    push_out(hybrid_engine)
    before = external_hits(hybrid_engine)
    reused = generate(hybrid_engine, second)
    assert external_hits(hybrid_engine) - before == reused.num_cached_tokens == 640
    own = generate(hybrid_engine, second)
    assert own.num_cached_tokens == 640
    assert list(reused.outputs[0].token_ids) == list(own.outputs[0].token_ids)


def _halt_sliding_window_group(worker: Any) -> bool:
    """Runs in the worker process: the sliding-window group's tier stops taking copies (a dead backend)."""
    group_sides(worker)[SWA_GROUP].worker.halt()
    return True


def test_a_load_that_fails_in_one_group_is_recomputed_whole(hybrid_engine: Any) -> None:
    # vLLM takes load failures of a model of several groups by request only: the failed load is told
    # as failed_recving, and the request recomputed with vLLM's own tokens, the engine unharmed
    tokens = prompt(77, 700)
    generate(hybrid_engine, tokens)
    own = generate(hybrid_engine, tokens)
    push_out(hybrid_engine)
    failed_before = kvcore_metric(hybrid_engine, "failed_load_blocks")
    assert hybrid_engine.collective_rpc(_halt_sliding_window_group) == [True]
    again = generate(hybrid_engine, tokens)
    assert kvcore_metric(hybrid_engine, "failed_load_blocks") > failed_before
    assert list(again.outputs[0].token_ids) == list(own.outputs[0].token_ids)
    assert kvcore_metric(hybrid_engine, "pool_pinned") == 0
    # the halted copies ended, so the group copies again: the next reuse loads
    push_out(hybrid_engine)
    before = external_hits(hybrid_engine)
    reused = generate(hybrid_engine, tokens)
    assert external_hits(hybrid_engine) - before == reused.num_cached_tokens == 640
    assert list(reused.outputs[0].token_ids) == list(own.outputs[0].token_ids)


def test_a_model_of_sliding_window_layers_only_loads_the_window(vllm_env: Path) -> None:
    # one KV-cache group, of sliding-window layers: served by the grouped sides too (its failures told
    # by request), a hit loading the last window's blocks only
    config = kvcore_transfer_config(backend={"kind": "cpu", "size": "64MiB"}, chunk_tokens=CHUNK)
    llm = start_hybrid_engine(make_tiny_hybrid_model(vllm_env / "tiny-sliding", sliding_only=True), config)
    try:
        tokens = prompt(1000, 1000)
        generate(llm, tokens)
        own = generate(llm, tokens)
        assert own.num_cached_tokens == 896
        assert reset_cache(llm)  # vLLM's own cache only: kvcore keeps its chunks
        before = external_hits(llm)
        again = generate(llm, tokens)
        assert external_hits(llm) - before == again.num_cached_tokens == 896
        assert list(again.outputs[0].token_ids) == list(own.outputs[0].token_ids)
        (((digests, same, block_bytes),),) = llm.collective_rpc(group_loads)
        assert same
        assert len(digests) == window_blocks(896)
        assert block_bytes == BLOCK * TOKEN_BYTES  # one block of the group: its four layers
    finally:
        stop_engine(llm)
