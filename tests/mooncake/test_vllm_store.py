"""Two real vLLM engines (CPU build, tiny model) on one Mooncake pool held by a segment holder.

Engine A serves a prompt and publishes its KV; A stops; engine B, a separate engine with an empty prefix
cache, serves the same prompt with external hits: tokens equal to vLLM's own prefix hit of the same
length (A's second run), KV bytes equal to what A saved. An engine in another namespace epoch gets no hit
from the same pool.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
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
from tests.mooncake.conftest import Master

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::PendingDeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(scope="module")
def holder(master: Master) -> Iterator[str]:
    """A segment holder: the pool lives here, so it outlives the engines (which contribute nothing)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcore_mooncake.holder",
            "--master",
            master.address,
            "--segment-size",
            "256MiB",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready"), line
    yield master.address
    proc.terminate()
    proc.wait(timeout=30)


def _engine(model: Path, master: str, epoch: str) -> Any:
    backend = {"kind": "mooncake_store", "master": master, "segment_size": 0, "local_size": "64MiB"}
    return start_engine(model, kvcore_transfer_config(backend=backend, epoch=epoch))


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


def test_a_second_engine_hits_what_the_first_saved(tiny_model: Path, holder: str) -> None:
    tokens = prompt(4242, 4 * BLOCK + 60)
    a = _engine(tiny_model, holder, epoch="0")
    try:
        first = generate(a, tokens)
        local = generate(a, tokens)  # vLLM's own prefix hit of 4 blocks: the reference tokens
        assert (first.num_cached_tokens, local.num_cached_tokens) == (0, 4 * BLOCK)
        (saved,) = a.collective_rpc(_host_digests)
    finally:
        stop_engine(a)  # the pool outlives engine A: it lives in the holder

    other = _engine(tiny_model, holder, epoch="1")
    try:
        before = _external_hits(other)  # the metrics registry is per process: count deltas
        isolated = generate(other, tokens)
        assert isolated.num_cached_tokens == 0  # another namespace epoch: no key of A's matches
        assert _external_hits(other) == before
    finally:
        stop_engine(other)

    b = _engine(tiny_model, holder, epoch="0")
    try:
        before = _external_hits(b)
        again = generate(b, tokens, kv_transfer_params={"num_extra_cached_tokens": True})
        assert again.num_cached_tokens == 4 * BLOCK
        assert _external_hits(b) - before == 4 * BLOCK
        assert again.kv_transfer_params == {"num_extra_cached_tokens": 4 * BLOCK}
        assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)
        ((digests, same),) = b.collective_rpc(_loaded)
        assert same
        assert len(digests) == 4
        assert set(digests) <= saved  # byte for byte what engine A saved
        assert len(set(digests)) == 4  # four distinct blocks, none left blank
    finally:
        stop_engine(b)
