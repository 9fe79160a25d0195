"""A real engine whose step outlasts the lookup deadline, on a real LMCache server: no false misses.

An LMCache lookup is two server rounds (the lookup, then its prefetch status). Driven only when vLLM asks
again, once per engine step, the second round waited for the next step, and a deadline judged then fired
whenever the step in between outlasted it: every request whose lookup spanned a long prefill was served
as a miss and recomputed its prefix. Here the stored prompts arrive while a batch of long prompts is in
chunked prefill, every step several times the lookup deadline: each stored prompt must still come back
from the server, whole, with the tokens of vLLM's own prefix hit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.integration.conftest import (  # the shared vLLM fixtures and helpers
    BLOCK,
    VLLM_MARKS,
    generate,
    kvcore_transfer_config,
    prompt,
    reset_cache,
    start_engine,
    stop_engine,
    tiny_model,
    vllm_env,
)
from tests.integration.probes import external_hits, kvcore_metric
from tests.lmcache.conftest import LMCacheServer

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS

LOOKUP_S = 0.05  # the lookup deadline: a local server answers both rounds in a few milliseconds
STORED = 4  # prompts stored on the server, 4 blocks each
LONG = 24  # long prompts in prefill together, each at most PER_STEP tokens a step (chunked prefill)
LONG_TOKENS = 15 * BLOCK
PER_STEP = 4 * BLOCK
LONG_STEPS = -(-LONG_TOKENS // PER_STEP)
BATCH_TOKENS = LONG * PER_STEP + STORED * 5 * BLOCK  # the long prefills leave room for the stored prompts


def _step_until_done(engine: Any, bound_s: float) -> tuple[dict[str, Any], dict[str, float]]:
    """Every request's final output, and when (monotonic) each finished."""
    outputs: dict[str, Any] = {}
    finished: dict[str, float] = {}
    deadline = time.monotonic() + bound_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish its requests"
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
                finished[out.request_id] = time.monotonic()
    return outputs, finished


def test_a_lookup_that_spans_a_long_step_is_still_a_hit(
    tiny_model: Path, lmcache_server: LMCacheServer
) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    assert lmcache_server.chunk_tokens == BLOCK
    backend = {"kind": "lmcache_mp", "url": lmcache_server.url, "request_timeout_s": 5.0}
    config = kvcore_transfer_config(backend=backend, chunk_tokens=BLOCK, lookup_timeout_s=LOOKUP_S)
    llm = start_engine(
        tiny_model,
        config,
        kv_cache_memory_bytes=2 * (LONG * LONG_TOKENS + STORED * 5 * BLOCK) * 512,
        max_num_batched_tokens=BATCH_TOKENS,
        long_prefill_token_threshold=PER_STEP,
        max_num_seqs=LONG + STORED,
    )
    try:
        stored = [prompt(7100 + i, 4 * BLOCK + 40) for i in range(STORED)]
        reference = []
        for tokens in stored:
            generate(llm, tokens)  # published to the server
            reference.append(list(generate(llm, tokens).outputs[0].token_ids))  # vLLM's own prefix hit
        assert reset_cache(llm)  # vLLM's own cache only: the server is the one place left to hit
        hits_before, hit_tokens_before = external_hits(llm), kvcore_metric(llm, "hit_tokens")

        engine = llm.llm_engine
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        longs = [prompt(7200 + i, LONG_TOKENS) for i in range(LONG)]
        for i, tokens in enumerate(longs):  # their prefill runs in several long steps
            engine.add_request(
                f"long-{i}", TokensPrompt(prompt_token_ids=tokens), SamplingParams(max_tokens=1)
            )
        added = time.monotonic()
        for i, tokens in enumerate(stored):  # their lookups begin while the long prefills run
            engine.add_request(f"stored-{i}", TokensPrompt(prompt_token_ids=tokens), greedy)
        outputs, finished = _step_until_done(engine, 120)
        # the long prompts end with their prefill (one token each)
        step_s = (
            max(at for request, at in finished.items() if request.startswith("long-")) - added
        ) / LONG_STEPS
        assert step_s > 2.5 * LOOKUP_S, f"a long step took {step_s:.3f}s: too short to test the deadline"

        for i in range(STORED):
            assert list(outputs[f"stored-{i}"].outputs[0].token_ids) == reference[i]
        assert external_hits(llm) - hits_before == STORED * 4 * BLOCK  # every stored prompt, whole
        assert kvcore_metric(llm, "hit_tokens") - hit_tokens_before == STORED * 4 * BLOCK
    finally:
        stop_engine(llm)
