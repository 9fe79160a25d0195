"""The disk tier across an engine restart, on real vLLM CPU engines.

Engine A, configured with a stack of tiers (a host pool, then the disk), saves a prompt's chunks to a
directory and exits. Engine B, a new engine process with the same config, starts with an empty vLLM
cache and an empty host pool: its first run of the prompt gets every whole block from the files
(external hits), with the greedy tokens of its second run, which is vLLM's own prefix hit of the same
length; the blocks it loaded hold exactly the bytes of the files. Written through, the disk gets the
chunks at their save; written back, only when the pool is about to evict them (other prompts fill it),
and the rest as the engine shuts down.
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
from tests.integration.probes import disk_chunk_values, engine_metrics, external_hits, loaded_digests
from tests.integration.tp2 import LAYERS  # a chunk is one block here: a value is a run per layer

pytestmark = VLLM_MARKS

PROMPT = prompt(500, 4 * BLOCK + 40)  # four whole blocks (chunks of one block) and a tail


def _metric(llm: Any, name: str, tier: str | None = None) -> int:
    """The sum of ``vllm:kvcore_<name>`` (of remote tier ``tier``, 1 the first behind the pool)."""
    found = [
        m.value
        for m in engine_metrics(llm)
        if m.name == f"vllm:kvcore_{name}" and (tier is None or m.labels.get("tier") == tier)
    ]
    return int(sum(found))


def _config(store: Path, pool_size: str, write: str) -> dict[str, Any]:
    """A stack: the pool, then the disk written through or back."""
    tiers = [
        {"kind": "cpu", "size": pool_size},
        {"kind": "disk", "path": str(store), "size": "64MiB", "write": write},
    ]
    config = kvcore_transfer_config(partial_chunks="drop")
    del config["kv_connector_extra_config"]["backend"]
    config["kv_connector_extra_config"]["tiers"] = tiers
    return config


def _reused_from_disk(tiny_model: Path, config: dict[str, Any], files: dict[str, bytes]) -> list[int]:
    """A new engine's tokens for ``PROMPT``, every whole block loaded from the disk's ``files``; checked
    against vLLM's own prefix hit of the same length."""
    second = start_engine(tiny_model, config)
    try:
        before = external_hits(second)
        from_disk = list(generate(second, PROMPT).outputs[0].token_ids)
        assert external_hits(second) - before == 4 * BLOCK
        assert _metric(second, "tier_found_chunks", tier="1") == 4  # the disk found the four chunks
        ((digests, same),) = second.collective_rpc(loaded_digests)
        assert same
        assert set(digests) <= {hashlib.sha256(v).hexdigest() for v in files.values()}
        assert len(digests) == 4
        prefix_hit = generate(second, PROMPT)  # vLLM's own cache now holds the prompt's blocks
        assert prefix_hit.num_cached_tokens == 4 * BLOCK
        assert external_hits(second) - before == 4 * BLOCK
    finally:
        stop_engine(second)
    assert from_disk == list(prefix_hit.outputs[0].token_ids)
    return from_disk


def test_a_new_engine_process_reuses_the_chunks_the_last_one_left_on_disk(
    vllm_env: Path, tiny_model: Path, tmp_path: Path
) -> None:
    store = tmp_path / "kv"
    store.mkdir()
    config = _config(store, "4MiB", "through")
    first = start_engine(tiny_model, config)
    try:
        before = external_hits(first)
        recomputed = list(generate(first, PROMPT).outputs[0].token_ids)
        assert external_hits(first) == before
        assert _metric(first, "tier_stored_chunks", tier="1") == 4  # written through at the save
    finally:
        stop_engine(first)
    files = disk_chunk_values(store, LAYERS)
    assert len(files) == 4  # one value per whole chunk (a file per KV head of it)
    assert all(len(v) == BLOCK * 512 for v in files.values())  # 512 bytes of KV per token
    assert _reused_from_disk(tiny_model, config, files) == recomputed


def test_a_disk_written_back_gets_the_chunks_the_pool_evicts_and_a_new_engine_reuses_them(
    vllm_env: Path, tiny_model: Path, tmp_path: Path
) -> None:
    store = tmp_path / "kv"
    store.mkdir()
    config = _config(store, f"{8 * BLOCK * 512}", "back")  # a pool of eight chunks
    first = start_engine(tiny_model, config)
    try:
        recomputed = list(generate(first, PROMPT).outputs[0].token_ids)
        assert disk_chunk_values(store, LAYERS) == {}  # the pool has room: nothing is written back yet
        for i in range(4):  # other prompts fill the pool: the prompt's chunks, least recently used, go
            generate(first, prompt(600 + i, 4 * BLOCK + 40))
        written = _metric(first, "written_back_chunks")
        assert written >= 4
        assert _metric(first, "failed_write_back_chunks") == 0
        assert _metric(first, "tier_stored_chunks", tier="1") == written
        saved = _metric(first, "saved_blocks")  # a chunk is a block here
        assert written < saved  # the last ones are still dirty in the pool
    finally:
        stop_engine(first)
    files = disk_chunk_values(store, LAYERS)
    assert len(files) == saved  # the worker wrote the rest back as it shut down: no saved chunk lost
    assert _reused_from_disk(tiny_model, config, files) == recomputed
