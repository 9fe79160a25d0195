"""Engines whose pages hold other bytes share no chunk, on real vLLM CPU engines and a shared disk tier.

A bf16 model run with ``kv_cache_dtype="float16"`` holds float16 pages. Engine A (float16 cache) leaves a
prompt's chunks on disk; engine B (``auto``: bfloat16 pages) finds none of them, and leaves its own;
engine C (float16 again, a new process) finds A's chunks (not B's), loads them byte for byte, and its
tokens are those of vLLM's own prefix hit of the same length. Every other field of the namespace is
checked on vLLM's configs without an engine (``tests/adapters/test_vllm_namespace.py``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tests.integration.conftest import (
    BLOCK,
    VLLM_MARKS,
    generate,
    kvcore_transfer_config,
    prompt,
    start_engine,
    stop_engine,
)
from tests.integration.probes import disk_chunk_values, external_hits, loaded_digests
from tests.integration.tp2 import LAYERS  # a chunk is one block here: a value is a run per layer

pytestmark = VLLM_MARKS

PROMPT = prompt(700, 4 * BLOCK + 40)  # four whole blocks (chunks of one block) and a tail


def _config(store: Path) -> dict[str, Any]:
    config = kvcore_transfer_config(partial_chunks="drop")
    extra = config["kv_connector_extra_config"]
    del extra["backend"]
    extra["tiers"] = [{"kind": "cpu", "size": "4MiB"}, {"kind": "disk", "path": str(store), "size": "64MiB"}]
    return config


def _run(model: Path, store: Path, cache_dtype: str) -> tuple[int, list[int], Any]:
    """A fresh engine's external hits and tokens for ``PROMPT``, and its worker's digests of what it
    loaded (with whether the engine blocks equal the host blocks)."""
    llm = start_engine(model, _config(store), kv_cache_dtype=cache_dtype)
    try:
        before = external_hits(llm)
        tokens = list(generate(llm, PROMPT).outputs[0].token_ids)
        hits = external_hits(llm) - before
        loaded = llm.collective_rpc(loaded_digests)[0] if hits else None
        if hits:
            prefix_hit = generate(llm, PROMPT)  # vLLM's own cache holds the prompt's blocks now
            assert prefix_hit.num_cached_tokens == 4 * BLOCK
            assert tokens == list(prefix_hit.outputs[0].token_ids)
    finally:
        stop_engine(llm)
    return hits, tokens, loaded


def test_a_float16_cache_of_a_bf16_model_is_shared_only_with_float16_caches(
    vllm_env: Path, tiny_model: Path, tmp_path: Path
) -> None:
    store = tmp_path / "kv"
    store.mkdir()
    hits, _, _ = _run(tiny_model, store, "float16")
    assert hits == 0
    fp16_files = disk_chunk_values(store, LAYERS)
    assert len(fp16_files) == 4

    hits, _, _ = _run(tiny_model, store, "auto")  # bfloat16 pages: A's float16 bytes are not its KV
    assert hits == 0
    bf16_files = {
        name: data for name, data in disk_chunk_values(store, LAYERS).items() if name not in fp16_files
    }
    assert len(bf16_files) == 4  # its own chunks, beside A's

    hits, _, loaded = _run(tiny_model, store, "float16")
    assert hits == 4 * BLOCK
    digests, same = loaded
    assert same  # the engine's blocks hold what the host blocks hold
    values = {hashlib.sha256(value).hexdigest() for value in fp16_files.values()}
    assert len(digests) == 4
    assert set(digests) <= values  # A's float16 chunks, byte for byte: none of B's
