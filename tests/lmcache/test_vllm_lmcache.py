"""Two real vLLM engines (CPU build, tiny model) on one LMCache server, blocks straight into and out of the
server's slots (no ``local_size``, the default). The pool-in-front path runs the same connector code as
the Mooncake engine test (``tests/mooncake/test_vllm_store.py``), with this backend's tier tested on its
own in ``test_conformance.py`` and ``test_faults.py``.

Engine A serves two prompts and publishes their KV to the server; vLLM's own prefix hit of each gives the
reference tokens; A stops. Engine B, a separate engine with empty local caches, serves both prompts with
external hits from the server, loaded asynchronously: tokens equal to the reference, the extra cached
tokens answered under kvcore's key and under LMCache's drop-in key, and the loaded KV bytes equal to what
A saved. With chunks of two blocks, a prompt that ends past a whole block of its last chunk is served
that block too, from the server (LMCache's own connector stops at the last whole chunk).
"""

from __future__ import annotations

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
from tests.integration.probes import engine_digests, external_hits, kvcore_metric, loaded_digests, rank_worker
from tests.lmcache.conftest import LMCacheServer, ServerFactory

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS

CHUNKS = 4  # full chunks (= vLLM blocks) per prompt; each prompt also has a partial block


def has_host_pool(worker: Any) -> bool:
    """In the worker process: whether kvcore's worker holds a host pool."""
    return rank_worker(worker).host is not None


def _engine(model: Path, server: LMCacheServer) -> Any:
    backend = {"kind": "lmcache_mp", "url": server.url, "request_timeout_s": 5.0}
    return start_engine(model, kvcore_transfer_config(backend=backend, chunk_tokens=server.chunk_tokens))


def _reference(llm: Any, tokens: list[int], cached: int) -> tuple[list[int], set[str]]:
    """Serve ``tokens`` twice on ``llm``: the second's greedy tokens, from vLLM's own prefix hit of
    ``cached`` tokens, and the digests of every engine block (what ``llm`` can have published)."""
    first = generate(llm, tokens)
    local = generate(llm, tokens)
    assert (first.num_cached_tokens, local.num_cached_tokens) == (0, cached)
    (saved,) = llm.collective_rpc(engine_digests)
    return list(local.outputs[0].token_ids), saved


def test_a_second_engine_loads_what_the_first_published(
    tiny_model: Path, lmcache_server: LMCacheServer
) -> None:
    assert lmcache_server.chunk_tokens % BLOCK == 0
    prompts = [prompt(seed, CHUNKS * BLOCK + 60) for seed in (6161, 6262)]
    a = _engine(tiny_model, lmcache_server)
    try:
        reference = [_reference(a, tokens, CHUNKS * BLOCK)[0] for tokens in prompts]
        (saved,) = a.collective_rpc(engine_digests)  # what A can have published: its own blocks
        assert a.collective_rpc(has_host_pool) == [False]  # nothing of kvcore's between them and the server
    finally:
        stop_engine(a)  # what A published lives on in the server

    b = _engine(tiny_model, lmcache_server)
    try:
        for n, (tokens, key) in enumerate(
            zip(prompts, ("num_extra_cached_tokens", "num_lmcache_extra_cached_tokens"), strict=True)
        ):
            out = generate(b, tokens, kv_transfer_params={key: True})
            assert kvcore_metric(b, "async_loads") == n + 1  # from the server: the request waited alone
            assert out.num_cached_tokens == CHUNKS * BLOCK
            assert external_hits(b) == (n + 1) * CHUNKS * BLOCK
            assert out.kv_transfer_params == {key: CHUNKS * BLOCK}
            assert list(out.outputs[0].token_ids) == reference[n]
            ((digests, same),) = b.collective_rpc(loaded_digests)
            assert same
            assert len(digests) == CHUNKS
            assert set(digests) <= saved  # byte for byte what engine A saved
            assert len(set(digests)) == CHUNKS  # distinct blocks, none left blank
    finally:
        stop_engine(b)


def test_a_prompts_last_whole_block_inside_a_chunk_comes_from_the_server_too(
    tiny_model: Path, server_factory: ServerFactory
) -> None:
    # one engine (the test above crosses processes): with no host pool, once vLLM's own cache is reset
    # the server is the only place the blocks can come from
    server = server_factory(2 * BLOCK)  # chunks of two blocks
    server.start()
    tokens = prompt(6363, 5 * BLOCK + 60)  # two chunks, one whole block of the third, 60 tokens
    llm = _engine(tiny_model, server)
    try:
        reference, saved = _reference(llm, tokens, 5 * BLOCK)
        assert reset_cache(llm)  # vLLM's own cache only
        before = external_hits(llm)
        out = generate(llm, tokens, kv_transfer_params={"num_extra_cached_tokens": True})
        assert out.num_cached_tokens == external_hits(llm) - before == 5 * BLOCK  # LMCache's connector: 4
        assert out.kv_transfer_params == {"num_extra_cached_tokens": 5 * BLOCK}
        assert list(out.outputs[0].token_ids) == reference
        ((digests, same),) = llm.collective_rpc(loaded_digests)
        assert same
        assert len(set(digests)) == 5
        assert set(digests) <= saved
    finally:
        stop_engine(llm)
