"""A hybrid SSM model (Qwen3-Next style: Gated DeltaNet and full attention layers, made locally) through
kvcore on a real vLLM CPU engine, with prefix caching in vLLM's "align" mode for Mamba states.

vLLM keeps each GDN layer's state in a KV-cache group of its own: a block holds the state after its last
token where the request's computation stopped there (a prefill step's end, forced onto block ends, or a
decode step reaching one), the null block elsewhere. kvcore saves those states, positionally, and a hit
is a block end where the full attention group holds every chunk and each Mamba group the state: vLLM
then computes from it, so a wrong state would change the greedy tokens (the model's states decay slowly,
``make_tiny_ssm_model``). Reused tokens must equal those of vLLM's own prefix hit of the same length.

The engine runs vLLM's default ``prefix_cache_retention_interval`` (0): vLLM keeps few states, and hands
the blocks of the others out again at once, so kvcore's saves of them are fenced before the next forward
pass. A state computed token by token (decode) is not bit-equal to one computed by a prefill step over
the same tokens (vLLM's chunked kernel): greedy tokens after a hit on a decoded state differ from a
computation from nothing, exactly as after vLLM's own hit on it, which a second engine keeping every state
(``prefix_cache_retention_interval=None``) gives to compare with.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore_cli.tiny_model import make_tiny_ssm_model
from tests.integration.conftest import (
    VLLM_MARKS,
    generate,
    kvcore_transfer_config,
    prompt,
    reset_cache,
    start_engine,
    stop_engine,
)
from tests.integration.probes import group_loads

pytestmark = [*VLLM_MARKS, pytest.mark.slow]

BLOCK = 256  # vLLM raises the block size so that an attention page holds a Mamba state
STATE_BYTES = 3 * 512 * 2 + 4 * 64 * 64 * 4  # a GDN layer's conv state (bf16) and temporal state (fp32)
ATTENTION_BLOCK_BYTES = BLOCK * 2 * 2 * 64 * 2  # K and V of 2 heads of 64 per token, bf16
STATE_GROUPS, FULL_GROUP = (0, 1, 2), 3  # vLLM's group order: one group per GDN layer, then attention
EXTRA = {"num_extra_cached_tokens": True}
"""A request's ``kv_transfer_params`` asking for the tokens kvcore served it (vLLM's metrics would not do:
a second engine in the process takes the metrics registry over)."""


@pytest.fixture(scope="module")
def ssm_model(vllm_env: Path) -> Path:
    return make_tiny_ssm_model(vllm_env / "tiny-ssm")


def start_ssm_engine(model: Path, max_num_batched_tokens: int = 1024, **engine_args: Any) -> Any:
    """An engine with kvcore's CPU pool, whose chunks are vLLM's block (no ``chunk_tokens`` set: a hybrid
    SSM model's chunks default to the block size vLLM picks for it)."""
    config = kvcore_transfer_config(backend={"kind": "cpu", "size": "64MiB"})
    del config["kv_connector_extra_config"]["chunk_tokens"]
    return start_engine(
        model,
        config,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=True,
        max_num_batched_tokens=max_num_batched_tokens,
        **engine_args,
    )


@pytest.fixture(scope="module")
def ssm_engine(ssm_model: Path) -> Iterator[Any]:
    llm = start_ssm_engine(ssm_model)
    yield llm
    stop_engine(llm)


@pytest.fixture(scope="module")
def keeping_engine(ssm_model: Path) -> Iterator[Any]:
    """An engine whose own cache keeps every state (``prefix_cache_retention_interval=None``), with steps
    of at most 384 tokens: not a multiple of the block, so its prefill steps are cut where vLLM's
    scheduler aligns them."""
    llm = start_ssm_engine(ssm_model, max_num_batched_tokens=384, prefix_cache_retention_interval=None)
    yield llm
    stop_engine(llm)


def fresh(llm: Any, tokens: list[int], max_tokens: int = 8) -> list[int]:
    """Greedy tokens computed from nothing: under a cache salt of their own, neither vLLM's cache nor
    kvcore's holds a block of them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    salted = TokensPrompt(prompt_token_ids=tokens, cache_salt=f"fresh-{len(tokens)}-{tokens[-1]}")
    (out,) = llm.generate([salted], params, use_tqdm=False)
    assert out.num_cached_tokens == 0
    return list(out.outputs[0].token_ids)


def test_kvcore_serves_each_mamba_group_and_vllm_keeps_its_hybrid_manager(ssm_engine: Any) -> None:
    assert ssm_engine.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    (groups,) = ssm_engine.collective_rpc(group_loads)
    block_bytes = [group_bytes for _, _, group_bytes in groups]
    # a state group's block is the state's bytes, not vLLM's page padded to an attention page
    assert block_bytes == [STATE_BYTES] * len(STATE_GROUPS) + [ATTENTION_BLOCK_BYTES]


def test_a_state_comes_back_from_kvcore_as_from_vllms_own_hit(ssm_engine: Any) -> None:
    # 700 tokens are computed in two steps, 0 -> 512 -> 700 (vLLM ends a prefill step at the last block
    # end before the prompt's last token): the state after 512 is kept, and reused by vLLM, then by kvcore
    tokens = prompt(71, 700)
    computed = fresh(ssm_engine, tokens)
    for _ in range(2):
        generate(ssm_engine, tokens)
    own = generate(ssm_engine, tokens)
    assert own.num_cached_tokens == 2 * BLOCK
    assert reset_cache(ssm_engine)  # vLLM's own cache only: kvcore keeps its chunks
    reused = generate(ssm_engine, tokens, kv_transfer_params=EXTRA)
    assert reused.kv_transfer_params == {"num_extra_cached_tokens": reused.num_cached_tokens}
    assert reused.num_cached_tokens == 2 * BLOCK
    assert list(reused.outputs[0].token_ids) == list(own.outputs[0].token_ids) == computed
    loads = ssm_engine.collective_rpc(group_loads)[0]
    for group in STATE_GROUPS:  # one block each: the state at the hit's end, the bytes kvcore saved
        digests, same, block_bytes = loads[group]
        assert same  # every loaded block holds the bytes of the slot it was loaded from
        assert (len(digests), block_bytes) == (1, STATE_BYTES)
    digests, same, _ = loads[FULL_GROUP]
    assert same
    assert len(set(digests)) == len(digests) == 2


def test_a_decode_that_reaches_a_block_end_keeps_the_state_there(
    ssm_engine: Any, keeping_engine: Any
) -> None:
    # a prompt of 700 tokens decodes 100 more: the step that computes token 768 leaves the state after
    # 768 in its block, which vLLM copies forward before the next token; kvcore saves it, and the next
    # turn (the conversation so far, 800 tokens) is served 768 tokens, as vLLM's own cache serves it in
    # an engine that keeps every state (this one keeps none of a decode)
    first = prompt(72, 700)
    second = first + _decoded(ssm_engine, first)
    assert reset_cache(ssm_engine)
    reused = generate(ssm_engine, second, kv_transfer_params=EXTRA)
    assert reused.kv_transfer_params == {"num_extra_cached_tokens": reused.num_cached_tokens}
    assert reused.num_cached_tokens == 3 * BLOCK
    assert first + _decoded(keeping_engine, first) == second
    own = generate(keeping_engine, second)
    assert own.num_cached_tokens == 3 * BLOCK
    assert list(reused.outputs[0].token_ids) == list(own.outputs[0].token_ids)


def _decoded(llm: Any, tokens: list[int]) -> list[int]:
    """100 greedy tokens after ``tokens``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def test_a_prefix_without_a_state_at_its_end_is_not_served(ssm_engine: Any) -> None:
    # a prompt sharing 300 tokens with one served before: the attention chunk of tokens 0-255 is held,
    # but no state after 256 exists (the first step computed 0 -> 512 at once), so nothing is served
    shared = prompt(73, 700)
    generate(ssm_engine, shared)
    other = shared[:300] + prompt(74, 400)
    assert reset_cache(ssm_engine)
    served = generate(ssm_engine, other, kv_transfer_params=EXTRA)
    assert served.kv_transfer_params == {"num_extra_cached_tokens": served.num_cached_tokens}
    assert served.num_cached_tokens == 0
    assert list(served.outputs[0].token_ids) == fresh(ssm_engine, other)


def test_prefill_steps_end_on_block_ends_so_every_hit_holds_the_state_at_its_end(
    ssm_engine: Any, keeping_engine: Any
) -> None:
    # vLLM's CPU platform resets the scheduler's block size to 128 after start-up; kvcore sets it back to
    # the Mamba block (``StateSteps``). Cut at 128: a 650-token prompt in steps of at most 384 tokens runs
    # 0 -> 384 -> 640 -> 650, the block of tokens 256-511 keeps the state after 384, and vLLM's own cache
    # serves it as the state after 512 (other tokens than a computation from nothing); cut at the block,
    # 0 -> 256 -> 512 -> 650
    tokens = prompt(75, 650)
    generate(keeping_engine, tokens)
    follow = tokens[:600] + prompt(76, 100)
    own = generate(keeping_engine, follow)
    assert own.num_cached_tokens == 2 * BLOCK
    assert list(own.outputs[0].token_ids) == fresh(keeping_engine, follow)
    # cut at 128, a 700-token prompt seen for the first time runs 0 -> 640 -> 700 and leaves no state at a
    # block end for kvcore to keep; cut at the block, 0 -> 512 -> 700, and kvcore serves 512 tokens
    first = prompt(77, 700)
    computed = generate(ssm_engine, first)
    assert reset_cache(ssm_engine)
    reused = generate(ssm_engine, first, kv_transfer_params=EXTRA)
    assert reused.kv_transfer_params == {"num_extra_cached_tokens": reused.num_cached_tokens}
    assert reused.num_cached_tokens == 2 * BLOCK
    assert list(reused.outputs[0].token_ids) == list(computed.outputs[0].token_ids)
