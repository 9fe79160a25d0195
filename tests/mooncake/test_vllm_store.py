"""Real vLLM engines (CPU build, tiny model) on one Mooncake pool held by a segment holder.

Engine A serves a prompt and publishes its KV; A stops; an engine in another namespace epoch gets no hit
from the same pool; engine B, a separate engine with an empty prefix cache, serves the same prompt with
external hits: tokens equal to vLLM's own prefix hit of the same length (A's second run), KV bytes equal
to what A saved, loaded asynchronously (the request waiting alone). Then, in B, the holder is frozen and
killed under loads that wait on it: each ends in a bounded recompute with vLLM's own tokens.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcore.testing.support import start_owned
from kvcore_cli.tiny_model import HYBRID_WINDOW, make_tiny_two_block_model
from tests.frozen import freeze, thaw
from tests.integration.conftest import (  # the shared vLLM fixtures and helpers
    BLOCK,
    VLLM_MARKS,
    generate,
    kvcore_transfer_config,
    prompt,
    start_engine,
    stop_engine,
    tiny_model,
    vllm_env,
)
from tests.integration.probes import external_hits, group_loads, host_digests, kvcore_metric, loaded_digests
from tests.mooncake.conftest import Master, MasterFactory

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS

TRANSFER_TIMEOUT_S = 3.0


def _start_holder(master: Master) -> subprocess.Popen[str]:
    """A segment holder: the pool lives here, so it outlives the engines (which contribute nothing)."""
    argv = [
        sys.executable,
        "-m",
        "kvcore_mooncake.holder",
        "--master",
        master.address,
        "--segment-size",
        "256MiB",
    ]
    proc = start_owned(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready"), line
    return proc


def _engine(model: Path, master: str, epoch: str, local_size: str = "64MiB", **config: Any) -> Any:
    backend = {"kind": "mooncake_store", "master": master, "segment_size": 0, "local_size": local_size}
    return start_engine(model, kvcore_transfer_config(backend=backend, epoch=epoch, **config))


def test_a_second_engine_hits_what_the_first_saved_and_a_failing_store_is_recomputed(
    tiny_model: Path, master_factory: MasterFactory
) -> None:
    # a master of its own, that keeps a frozen holder's objects (the suite's drops them after 2 s)
    master = master_factory("--client_ttl=600")
    holder = _start_holder(master)
    try:
        tokens = prompt(4242, 4 * BLOCK + 60)
        a = _engine(tiny_model, master.address, epoch="0")
        try:
            first = generate(a, tokens)
            local = generate(a, tokens)  # vLLM's own prefix hit of 4 blocks: the reference tokens
            assert (first.num_cached_tokens, local.num_cached_tokens) == (0, 4 * BLOCK)
            (saved,) = a.collective_rpc(host_digests)
        finally:
            stop_engine(a)  # the pool outlives engine A: it lives in the holder

        other = _engine(tiny_model, master.address, epoch="1")
        try:
            before = external_hits(other)  # the metrics registry is per process: count deltas
            isolated = generate(other, tokens)
            assert isolated.num_cached_tokens == 0  # another namespace epoch: no key of A's matches
            assert external_hits(other) == before
        finally:
            stop_engine(other)

        # a pool of 16 chunks, so that a few prompts push others out of it (and out of vLLM's 24 blocks)
        b = _engine(tiny_model, master.address, "0", local_size="1MiB", transfer_timeout_s=TRANSFER_TIMEOUT_S)
        try:
            _check_reuse(b, tokens, list(local.outputs[0].token_ids), saved)
            _check_failing_store(b, holder)
        finally:
            stop_engine(b)
    finally:
        if holder.poll() is None:
            thaw(holder.pid)
            holder.kill()
        holder.wait(timeout=30)


def _check_reuse(b: Any, tokens: list[int], reference: list[int], saved: set[str]) -> None:
    """Engine B, its caches empty, serves what engine A saved from the store: asynchronously, with vLLM's
    own tokens, and byte for byte."""
    before = external_hits(b)
    again = generate(b, tokens, kv_transfer_params={"num_extra_cached_tokens": True})
    assert kvcore_metric(b, "async_loads") == 1  # a load from the store: the request waited alone
    assert again.num_cached_tokens == 4 * BLOCK
    assert external_hits(b) - before == 4 * BLOCK
    assert again.kv_transfer_params == {"num_extra_cached_tokens": 4 * BLOCK}
    assert list(again.outputs[0].token_ids) == reference
    ((digests, same),) = b.collective_rpc(loaded_digests)
    assert same
    assert len(digests) == 4
    assert set(digests) <= saved  # byte for byte what engine A saved
    assert len(set(digests)) == 4  # four distinct blocks, none left blank


def _step_until(engine: Any, done: Callable[[], bool], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, f"not done within {within_s}s"
        engine.step()


def _check_failing_store(llm: Any, holder: subprocess.Popen[str]) -> None:
    """Asynchronous loads from the store, the segment holder frozen (SIGSTOP) under two of them and killed
    under a third while they wait: a request aborted while it waits ends, the others are recomputed, their
    tokens those of vLLM's own prefix hit, the frozen one within about ``transfer_timeout_s``, and nothing
    stays pinned or in flight once the holder is gone for good."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [prompt(seed, 4 * BLOCK + 60) for seed in (4343, 4444)]
    reference = []
    for tokens in prompts:
        generate(llm, tokens)
        reference.append(list(generate(llm, tokens).outputs[0].token_ids))  # vLLM's own hit
    for seed in range(3):
        generate(llm, prompt(4500 + seed, 1500), max_tokens=1)
    # the fillers' publishes end before the freeze: a publish still waiting on the frozen holder keeps its
    # slot (of the 16) until its transfer times out, and the loads below need slots for their fetches
    _settle(llm)
    failed = kvcore_metric(llm, "failed_load_blocks")
    loads = kvcore_metric(llm, "async_loads")

    freeze(holder.pid)
    # a request aborted while it waits for its load: vLLM frees its blocks once the workers give the load
    # up (at its deadline); nothing else waits on it
    engine = llm.llm_engine
    engine.add_request("aborted", TokensPrompt(prompt_token_ids=prompts[1]), SamplingParams(max_tokens=4))
    _step_until(engine, lambda: kvcore_metric(llm, "async_loads") >= loads + 1, 10)  # its load started
    engine.step()
    engine.abort_request(["aborted"])
    _step_until(engine, lambda: not engine.has_unfinished_requests(), TRANSFER_TIMEOUT_S + 15)

    started = time.monotonic()
    stalled = generate(llm, prompts[0])
    took = time.monotonic() - started
    thaw(holder.pid)
    assert list(stalled.outputs[0].token_ids) == reference[0]
    assert kvcore_metric(llm, "async_loads") == loads + 2
    assert TRANSFER_TIMEOUT_S <= took < TRANSFER_TIMEOUT_S + 15
    _settle(llm)  # likewise: the thawed holder ends the copies that waited on it

    # killed while a load waits on it (frozen first, so that the load is surely under way)
    freeze(holder.pid)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add_request("dead", TokensPrompt(prompt_token_ids=prompts[1]), greedy)
    _step_until(engine, lambda: kvcore_metric(llm, "async_loads") >= loads + 3, 10)
    holder.kill()
    holder.wait(timeout=30)
    dead: list[int] = []
    deadline = time.monotonic() + TRANSFER_TIMEOUT_S + 15
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        dead = next((list(o.outputs[0].token_ids) for o in engine.step() if o.finished), dead)
    assert dead == reference[1]

    _settle(llm)
    # every block of the three loads failed (a frozen fetch fails once it ends), none loaded
    assert kvcore_metric(llm, "failed_load_blocks") - failed == 3 * 4


def _settle(llm: Any) -> None:
    """Run steps until kvcore holds nothing: no slot pinned or being stored, no op in flight, no request
    (a step with a prompt shorter than a block loads and saves nothing, and reports the gauges)."""
    gauges = ("pool_pinned", "pool_storing", "ops_in_flight", "requests")
    deadline = time.monotonic() + 30
    while any(kvcore_metric(llm, g) for g in gauges) and time.monotonic() < deadline:
        generate(llm, prompt(4600, BLOCK - 20), max_tokens=1)
    assert {g: kvcore_metric(llm, g) for g in gauges} == dict.fromkeys(gauges, 0.0)


def test_two_hybrid_engines_share_their_chunks_through_the_store(vllm_env: Path, master: Master) -> None:
    # a Gemma-4-style model, vLLM's hybrid KV-cache manager on, its two KV-cache groups of two block
    # sizes (sliding window: 256 tokens, full attention: 128), chunks of 256 tokens: engine A saves both
    # groups of a prompt in the store; engine B, its caches empty, loads them (the sliding-window group
    # only its last window) with the tokens of A's own prefix hit, every block the bytes of the slot it
    # came through
    model = make_tiny_two_block_model(vllm_env / "tiny-two-block-store")
    holder = _start_holder(master)
    window_block, chunk = 2 * BLOCK, 2 * BLOCK
    try:
        backend = {
            "kind": "mooncake_store",
            "master": master.address,
            "segment_size": 0,
            "local_size": "64MiB",
        }
        config = kvcore_transfer_config(backend=backend, chunk_tokens=chunk)
        tokens = prompt(4343, 7 * BLOCK + 60)  # 956 tokens: 3 chunks before its last token
        a = start_engine(model, config, kv_cache_memory_bytes=16 << 20)
        try:
            generate(a, tokens)
            local = generate(a, tokens)
            assert local.num_cached_tokens == 3 * chunk
        finally:
            stop_engine(a)
        b = start_engine(model, config, kv_cache_memory_bytes=16 << 20)
        try:
            before = external_hits(b)
            again = generate(b, tokens)
            assert external_hits(b) - before == again.num_cached_tokens == 3 * chunk
            assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)
            ((swa, full),) = b.collective_rpc(group_loads)
            assert swa[1]
            assert full[1]
            # the window's tokens [568, 768) lie in one sliding-window block; the full group's 6 blocks
            window = 3 * chunk // window_block - (3 * chunk - HYBRID_WINDOW) // window_block
            assert (len(swa[0]), len(full[0])) == (window, 3 * chunk // BLOCK)
            assert swa[2] == full[2]  # one block of each group: the same page, of two block sizes
            # the groups share the 64 MiB pool in slot pairs: a chunk of each, 1 + 2 blocks
            assert kvcore_metric(b, "pool_capacity") == 2 * ((64 << 20) // (3 * full[2]))
        finally:
            stop_engine(b)
    finally:
        holder.kill()
        holder.wait(timeout=30)
