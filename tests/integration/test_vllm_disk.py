"""The disk tier across an engine restart, on real vLLM CPU engines.

Engine A, configured with a stack of tiers (a host pool, then the disk), saves a prompt's chunks to a
directory and exits. Engine B, a new engine process with the same
config, starts with an empty vLLM cache and an empty host pool: its first run of the prompt gets every
whole block from the files (external hits), with the greedy tokens of its second run, which is vLLM's own
prefix hit of the same length; the blocks it loaded hold exactly the bytes of the files.
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
from tests.integration.probes import external_hits, loaded_digests

pytestmark = VLLM_MARKS

PROMPT = prompt(500, 4 * BLOCK + 40)  # four whole blocks (chunks of one block) and a tail


def _file_values(root: Path) -> dict[str, bytes]:
    """Each chunk file's value (after its header), by file name."""
    from kvcore_disk.chunk_file import ChunkHeader, header_bytes

    values = {}
    for path in (root / "chunks").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            values[path.name] = data[header_bytes(ChunkHeader.unpack(data).key) :]
    return values


def _disk_hits(llm: Any) -> int:
    """``vllm:kvcore_tier_found_chunks{tier="1"}``: the chunks the first remote tier's lookups found."""
    found = [
        m.value
        for m in llm.get_metrics()
        if m.name == "vllm:kvcore_tier_found_chunks" and m.labels.get("tier") == "1"
    ]
    return int(sum(found))


def test_a_new_engine_process_reuses_the_chunks_the_last_one_left_on_disk(
    vllm_env: Path, tiny_model: Path, tmp_path: Path
) -> None:
    store = tmp_path / "kv"
    store.mkdir()
    tiers = [{"kind": "cpu", "size": "4MiB"}, {"kind": "disk", "path": str(store), "size": "64MiB"}]
    config = kvcore_transfer_config(partial_chunks="drop")
    del config["kv_connector_extra_config"]["backend"]
    config["kv_connector_extra_config"]["tiers"] = tiers  # a stack: the pool, then the disk

    first = start_engine(tiny_model, config)
    try:
        before = external_hits(first)
        recomputed = list(generate(first, PROMPT).outputs[0].token_ids)
        assert external_hits(first) == before
    finally:
        stop_engine(first)
    files = _file_values(store)
    assert len(files) == 4  # one file per whole chunk (TP 1: one shard)
    assert all(len(v) == BLOCK * 512 for v in files.values())  # 512 bytes of KV per token

    second = start_engine(tiny_model, config)
    try:
        before = external_hits(second)
        from_disk = list(generate(second, PROMPT).outputs[0].token_ids)
        assert external_hits(second) - before == 4 * BLOCK
        assert _disk_hits(second) == 4  # the stack's first remote tier found the four chunks
        ((digests, same),) = second.collective_rpc(loaded_digests)
        assert same
        assert sorted(digests) == sorted(hashlib.sha256(v).hexdigest() for v in files.values())
        prefix_hit = generate(second, PROMPT)  # vLLM's own cache now holds the prompt's blocks
        assert prefix_hit.num_cached_tokens == 4 * BLOCK
        assert external_hits(second) - before == 4 * BLOCK
    finally:
        stop_engine(second)
    assert from_disk == list(prefix_hit.outputs[0].token_ids)
    assert from_disk == recomputed
