"""kvcore in vLLM's OpenAI-compatible server, served as users serve it: a subprocess, HTTP, ``/metrics``.

One server for the module (the engine settings of ``conftest.start_engine``: a 24-block KV cache that
vLLM must evict from, eager mode, seed 0), driven with the standard library's HTTP client. Prompts are
token-id lists, so they are exact. The last test stops the server and checks that none of its processes
survive.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from attrs import frozen

from kvcore_vllm.stats import COUNTERS, GAUGES
from tests.integration.conftest import (
    BLOCK,
    ENGINE_BLOCKS,
    MAX_MODEL_LEN,
    VLLM_MARKS,
    kvcore_transfer_config,
    prompt,
)
from tests.integration.served import KV_BYTES_PER_TOKEN, ServedEngine, serve, session_processes

pytestmark = VLLM_MARKS

POOL_BYTES = 64 << 20  # kvcore_transfer_config's CPU pool

REUSED = prompt(100, 4 * BLOCK + 60)  # 4 full blocks and a tail
FILLERS = [prompt(200 + seed, 1500) for seed in range(3)]  # 3 x 12 of vLLM's 24 blocks: REUSED is pushed out
PROBE = prompt(5, BLOCK - 28)  # no full block: nothing of its own to save


@pytest.fixture(scope="module")
def served(
    vllm_env: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServedEngine]:
    log = tmp_path_factory.mktemp("served") / "server.log"
    config = kvcore_transfer_config()
    with serve(
        vllm_env, tiny_model, log, config, kv_cache_tokens=ENGINE_BLOCKS * BLOCK, max_model_len=MAX_MODEL_LEN
    ) as server:
        yield server


@frozen
class Reuse:
    """What the server answered: ``first`` (fresh), ``local`` (vLLM's own prefix hit) and ``again`` (after
    the fillers pushed the prompt out of vLLM's cache) for ``REUSED``; ``/metrics`` just before and after
    ``again`` and once settled; how many completions were sent in all."""

    first: dict[str, Any]
    local: dict[str, Any]
    fillers: list[dict[str, Any]]
    again: dict[str, Any]
    before: dict[str, float]
    after: dict[str, float]
    settled: dict[str, float]
    completions: int


LEAK_GAUGES = ("pool_pinned", "pool_storing", "ops_in_flight", "requests")


@pytest.fixture(scope="module")
def reuse(served: ServedEngine) -> Reuse:
    asked = {"num_extra_cached_tokens": True}
    first = served.complete(REUSED, kv_transfer_params=asked)
    local = served.complete(REUSED, kv_transfer_params=asked)
    fillers = [served.complete(tokens, max_tokens=1) for tokens in FILLERS]
    before = served.metrics()
    both = {"num_extra_cached_tokens": True, "num_lmcache_extra_cached_tokens": True}  # LMCache's name too
    again = served.complete(REUSED, kv_transfer_params=both)
    after = served.metrics()
    completions = 3 + len(fillers)
    # kvcore's gauges reach vLLM with the engine's steps, and an idle server runs none: a short request (a
    # lookup, nothing to save) publishes them as they are once the others are retired
    for _ in range(5):
        served.complete(PROBE, max_tokens=1)
        completions += 1
        settled = served.metrics()
        if not any(settled[f"vllm:kvcore_{name}"] for name in LEAK_GAUGES):
            break
    return Reuse(first, local, fillers, again, before, after, settled, completions)


def _text(answer: dict[str, Any]) -> tuple[str, list[int]]:
    (choice,) = answer["choices"]
    return choice["text"], choice["token_ids"]


def _cached_tokens(answer: dict[str, Any]) -> int:
    cached: int = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def _growth(reuse: Reuse, name: str) -> float:
    return reuse.after[name] - reuse.before[name]


def test_reused_after_eviction_with_equal_text(reuse: Reuse) -> None:
    text, token_ids = _text(reuse.again)
    assert len(token_ids) == 8
    assert (text, token_ids) == _text(reuse.first)
    assert (text, token_ids) == _text(reuse.local)  # vLLM's own prefix hit: the same split of the work
    assert [_cached_tokens(a) for a in (reuse.first, reuse.local, reuse.again)] == [0, 4 * BLOCK, 4 * BLOCK]
    # the 4 blocks came from kvcore, not from vLLM's cache
    assert _growth(reuse, "vllm:external_prefix_cache_hits_total") == 4 * BLOCK
    assert _growth(reuse, "vllm:kvcore_hit_tokens_total") == 4 * BLOCK
    assert _growth(reuse, "vllm:kvcore_loaded_blocks_total") == 4
    assert _growth(reuse, "vllm:kvcore_failed_load_blocks_total") == 0
    assert _growth(reuse, "vllm:kvcore_lookups_total") == 1


def test_extra_cached_tokens_answered_in_kv_transfer_params(reuse: Reuse) -> None:
    assert reuse.first["kv_transfer_params"] == {"num_extra_cached_tokens": 0}  # a fresh prompt
    assert reuse.local["kv_transfer_params"] == {"num_extra_cached_tokens": 0}  # all vLLM's own
    served = reuse.again["kv_transfer_params"]
    assert set(served) == {"num_extra_cached_tokens", "num_lmcache_extra_cached_tokens"}
    tokens = served["num_extra_cached_tokens"]
    assert tokens == served["num_lmcache_extra_cached_tokens"]
    assert 0 < tokens < len(REUSED)
    assert tokens % BLOCK == 0
    assert tokens == 4 * BLOCK
    # a request that asks nothing is answered nothing
    assert all(answer["kv_transfer_params"] is None for answer in reuse.fillers)


def test_kvcore_series_on_metrics(reuse: Reuse) -> None:
    values = reuse.settled
    counters = {name: values.get(f"vllm:kvcore_{name}_total") for name in COUNTERS}
    gauges = {name: values.get(f"vllm:kvcore_{name}") for name in GAUGES}
    assert None not in counters.values(), counters
    assert None not in gauges.values(), gauges
    saved = len(REUSED) // BLOCK + sum(len(tokens) // BLOCK for tokens in FILLERS)  # chunk = one block
    assert counters == {
        "lookups": reuse.completions,  # one per request, however often vLLM asks while it waits
        "hit_tokens": 4 * BLOCK,
        "loaded_blocks": 4,
        "async_loads": 0,  # from the host pool: synchronous
        "saved_blocks": saved,
        "failed_load_blocks": 0,
        "failed_save_chunks": 0,
        "save_retries": 0,  # no save failed: none tried again
        "written_back_chunks": 0,  # no tier written back
        "failed_write_back_chunks": 0,
        "assembled_chunks": 0,  # from the host pool: no tier keeps values per KV head here
    }
    assert gauges == {
        "pool_capacity": POOL_BYTES // (BLOCK * KV_BYTES_PER_TOKEN),
        "pool_capacity_bytes": POOL_BYTES,  # set at start-up, before the first request
        "pool_used": saved,  # nothing evicted from a pool this large
        "pool_pinned": 0,
        "pool_storing": 0,
        "pool_dirty": 0,
        "pool_evictions": 0,
        "requests": 0,
        "ops_in_flight": 0,
        "halted_ranks": 0,
    }
    assert values["vllm:external_prefix_cache_hits_total"] == 4 * BLOCK  # the server's lifetime


def test_stop_leaves_no_process(served: ServedEngine) -> None:
    running = session_processes(served.sid)
    assert served.process.pid in running
    commands = " | ".join(running.values())
    assert "EngineCore" in commands, commands  # vLLM's engine core, a child of the server
    assert "Worker" in commands, commands  # and its worker, a grandchild
    stopped = served.stop()
    assert not stopped.killed, served.log_tail()
    assert stopped.survivors == {}, served.log_tail()
    assert stopped.returncode == 0, served.log_tail()
    assert session_processes(served.sid) == {}
