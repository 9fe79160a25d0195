"""Two real vLLM engines (CPU build, tiny model) on one Mooncake pool held by a segment holder.

Engine A serves a prompt and publishes its KV; A stops; engine B, a separate engine with an empty prefix
cache, serves the same prompt with external hits: tokens equal to vLLM's own prefix hit of the same
length (A's second run), KV bytes equal to what A saved. An engine in another namespace epoch gets no hit
from the same pool.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore.testing.support import start_owned
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
from tests.integration.probes import external_hits, host_digests, loaded_digests
from tests.mooncake.conftest import Master

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS


@pytest.fixture(scope="module")
def holder(master: Master) -> Iterator[str]:
    """A segment holder: the pool lives here, so it outlives the engines (which contribute nothing)."""
    proc = start_owned(
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


def test_a_second_engine_hits_what_the_first_saved(tiny_model: Path, holder: str) -> None:
    tokens = prompt(4242, 4 * BLOCK + 60)
    a = _engine(tiny_model, holder, epoch="0")
    try:
        first = generate(a, tokens)
        local = generate(a, tokens)  # vLLM's own prefix hit of 4 blocks: the reference tokens
        assert (first.num_cached_tokens, local.num_cached_tokens) == (0, 4 * BLOCK)
        (saved,) = a.collective_rpc(host_digests)
    finally:
        stop_engine(a)  # the pool outlives engine A: it lives in the holder

    other = _engine(tiny_model, holder, epoch="1")
    try:
        before = external_hits(other)  # the metrics registry is per process: count deltas
        isolated = generate(other, tokens)
        assert isolated.num_cached_tokens == 0  # another namespace epoch: no key of A's matches
        assert external_hits(other) == before
    finally:
        stop_engine(other)

    b = _engine(tiny_model, holder, epoch="0")
    try:
        before = external_hits(b)
        again = generate(b, tokens, kv_transfer_params={"num_extra_cached_tokens": True})
        assert again.num_cached_tokens == 4 * BLOCK
        assert external_hits(b) - before == 4 * BLOCK
        assert again.kv_transfer_params == {"num_extra_cached_tokens": 4 * BLOCK}
        assert list(again.outputs[0].token_ids) == list(local.outputs[0].token_ids)
        ((digests, same),) = b.collective_rpc(loaded_digests)
        assert same
        assert len(digests) == 4
        assert set(digests) <= saved  # byte for byte what engine A saved
        assert len(set(digests)) == 4  # four distinct blocks, none left blank
    finally:
        stop_engine(b)
