"""Two real vLLM engines (CPU build, tiny model) on one LMCache server, kvcore's CPU tier in front.

Engine A serves two prompts and publishes their KV to the server; vLLM's own prefix hit of each gives the
reference tokens; A stops. Engine B, a separate engine with empty local caches, serves both prompts with
external hits from the server: tokens equal to the reference, the extra cached tokens answered under
kvcore's key and under LMCache's drop-in key, and the loaded KV bytes equal to what A saved.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import (  # the shared vLLM fixtures and helpers
    BLOCK,
    generate,
    kvcore_transfer_config,
    prompt,
    start_engine,
    stop_engine,
    tiny_model,
    vllm_env,
)
from tests.lmcache.conftest import LMCacheServer

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::PendingDeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

CHUNKS = 4  # full chunks (= vLLM blocks) per prompt; each prompt also has a partial block


def _engine(model: Path, server: LMCacheServer) -> Any:
    backend = {"kind": "lmcache_mp", "url": server.url, "local_size": "64MiB", "request_timeout_s": 5.0}
    return start_engine(model, kvcore_transfer_config(backend=backend, chunk_tokens=server.chunk_tokens))


def _external_hits(llm: Any) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")


def _host_digests(worker: Any) -> set[str]:
    """Runs in the worker process: digests of every host block of the rank's pool."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvcore_vllm.connector import KVCoreConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, KVCoreConnector)
    tier = connector.worker_side.worker
    return {hashlib.sha256(tier.host_block_bytes(b)).hexdigest() for b in range(tier.host.num_blocks)}


def _loaded(worker: Any) -> tuple[list[str], bool]:
    """Runs in the worker process: digests of the last loaded blocks, and whether the engine blocks hold
    exactly the host bytes they were loaded from."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvcore_vllm.connector import KVCoreConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, KVCoreConnector)
    side = connector.worker_side
    engine_blocks, host_blocks = side.last_load
    tier = side.worker
    same = all(
        tier.engine_block_bytes(e) == tier.host_block_bytes(h)
        for e, h in zip(engine_blocks, host_blocks, strict=True)
    )
    return [hashlib.sha256(tier.host_block_bytes(h)).hexdigest() for h in host_blocks], same


def test_a_second_engine_loads_what_the_first_published(
    tiny_model: Path, lmcache_server: LMCacheServer
) -> None:
    assert lmcache_server.chunk_tokens % BLOCK == 0
    prompts = [prompt(seed, CHUNKS * BLOCK + 60) for seed in (6161, 6262)]
    a = _engine(tiny_model, lmcache_server)
    try:
        reference = []
        for tokens in prompts:
            first = generate(a, tokens)
            local = generate(a, tokens)  # vLLM's own prefix hit of CHUNKS blocks: the reference tokens
            assert (first.num_cached_tokens, local.num_cached_tokens) == (0, CHUNKS * BLOCK)
            reference.append(list(local.outputs[0].token_ids))
        (saved,) = a.collective_rpc(_host_digests)
    finally:
        stop_engine(a)  # what A published lives on in the server

    b = _engine(tiny_model, lmcache_server)
    try:
        for n, (tokens, key) in enumerate(
            zip(prompts, ("num_extra_cached_tokens", "num_lmcache_extra_cached_tokens"), strict=True)
        ):
            out = generate(b, tokens, kv_transfer_params={key: True})
            assert out.num_cached_tokens == CHUNKS * BLOCK
            assert _external_hits(b) == (n + 1) * CHUNKS * BLOCK
            assert out.kv_transfer_params == {key: CHUNKS * BLOCK}
            assert list(out.outputs[0].token_ids) == reference[n]
            ((digests, same),) = b.collective_rpc(_loaded)
            assert same
            assert len(digests) == CHUNKS
            assert set(digests) <= saved  # byte for byte what engine A saved
            assert len(set(digests)) == CHUNKS  # distinct blocks, none left blank
    finally:
        stop_engine(b)
