"""kvcore on an LMCache server in a real vLLM engine at tensor-parallel size 2 (CPU build, tiny models).

One engine per model, each on a server of its own (so every object in it is that engine's), running
``tests.integration.tp2.reuse_flow`` once. Blocks move straight between each rank's engine blocks and
the server's shared-memory slots (no ``local_size``, the default): the prompt evicted from vLLM's cache
comes back from the server. Each rank registers with the server as a worker of its own. With one KV
head (replicated) rank 0 alone stores the shared chunks and both ranks retrieve them; with four (two
per rank) each rank stores and retrieves a value per KV head of its own, so the server holds four
times as many.
"""

from __future__ import annotations

import json
import urllib.request
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
    CHUNK,
    CHUNK_BLOCKS,
    EXPECTED_SAVED_CHUNKS,
    GAUGES,
    HEAD_COUNTS,
    PATIENCE_S,
    PROMPT_CHUNKS,
    TP,
    ReuseRun,
    check_bytes,
    check_reuse,
    engine_digests_probe,
    kv_heads_model,
    reuse_flow,
    start_tp_engine,
    tier_config,
)
from tests.lmcache.conftest import Launcher, LMCacheServer

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS


@frozen
class ServerRun:
    run: ReuseRun
    registered: tuple[int, ...]  # the workers registered with the server while the engine ran
    objects: int  # the objects the server holds after the flow


def _objects(server: LMCacheServer) -> int:
    """The objects in the server's L1 (its HTTP status)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/status", timeout=10) as reply:
        status = json.load(reply)
    return int(status["storage_manager"]["l1_manager"]["total_object_count"])


@pytest.fixture(scope="module", params=HEAD_COUNTS, ids=lambda heads: f"kv_heads={heads}")
def server_run(
    request: pytest.FixtureRequest,
    vllm_env: Path,
    lmcache_launcher: Launcher,
    tmp_path_factory: pytest.TempPathFactory,
) -> ServerRun:
    heads: int = request.param
    server = LMCacheServer(lmcache_launcher, tmp_path_factory.mktemp("lmcache-tp2"), CHUNK)
    server.start()
    try:
        backend = {"kind": "lmcache_mp", "url": server.url, "request_timeout_s": PATIENCE_S}
        llm = start_tp_engine(kv_heads_model(vllm_env, heads), heads, tier_config(backend))
        try:
            run = reuse_flow(llm, heads, engine_digests_probe, seed=9000 + heads)
            registered = tuple(server.registered())
        finally:
            stop_engine(llm)
        return ServerRun(run, registered, _objects(server))
    finally:
        server.kill()


def test_evicted_prompt_is_served_from_the_server_with_the_tokens_of_vllms_own_hit(
    server_run: ServerRun,
) -> None:
    check_reuse(server_run.run)


def test_each_rank_loads_its_shard_from_the_server(server_run: ServerRun) -> None:
    run = server_run.run
    # with one head, rank 1 retrieves what rank 0 stored (and computed the same bytes itself)
    check_bytes(run, writers=(0, 0) if run.kv_heads < TP else (0, 1))
    for load in run.loads:
        assert not load.host_blocks, "no kvcore pool between the engine and the server"


def test_each_rank_is_a_worker_of_its_own(server_run: ServerRun) -> None:
    assert len(set(server_run.registered)) == TP, server_run.registered


def test_server_holds_one_value_per_kv_head(server_run: ServerRun) -> None:
    run = server_run.run  # a replicated head is stored once, by rank 0
    assert server_run.objects == run.kv_heads * EXPECTED_SAVED_CHUNKS


def test_every_rank_reported_every_op(server_run: ServerRun) -> None:
    run = server_run.run
    assert run.gauges == dict.fromkeys(GAUGES, 0.0)
    assert run.counters == {
        "hit_tokens": PROMPT_CHUNKS * CHUNK_BLOCKS * BLOCK,
        "loaded_blocks": PROMPT_CHUNKS * CHUNK_BLOCKS,
        "async_loads": 1,  # from the server: the request waited alone
        "saved_blocks": EXPECTED_SAVED_CHUNKS * CHUNK_BLOCKS,
        "failed_load_blocks": 0,
        "failed_save_chunks": 0,
    }
