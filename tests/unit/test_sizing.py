"""The start-up check of every composition: a local pool too small to stage one step's saves to a remote
tier is named, with the field and the size that would do."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import ConfigError
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.plugins.sizing import pool_slots, staging_shortfall

BLOCK = 16
CHUNK = 64


def _engine(tp: int = 1) -> EngineSpec:
    layout = KVLayout(
        LayoutKind.VLLM_CPU, num_blocks=64, block_tokens=BLOCK, num_kv_heads=2, head_size=32, dtype_size=2
    )
    # two KV heads on every rank
    return EngineSpec("tiny@main", "bfloat16", num_layers=2, total_kv_heads=2 * tp, layout=layout, tp_size=tp)


def _config(backend: dict[str, Any]) -> KVCoreConfig:
    return load_config({"chunk_tokens": CHUNK, "backend": backend})


def test_the_cpu_tier_alone_is_never_short() -> None:
    engine = _engine()
    one_chunk = CHUNK * engine.host_block_bytes // BLOCK
    assert staging_shortfall(_config({"kind": "cpu", "size": one_chunk}), engine, 4096) is None


def test_a_remote_tier_names_the_field_and_the_size_that_stages_one_step() -> None:
    engine = _engine(tp=2)
    slot = CHUNK * engine.host_block_bytes // BLOCK  # one rank's shard of one chunk
    step = 4 * CHUNK + 1  # five chunks, the last one partial
    short = _config({"kind": "lmcache_mp", "local_size": 4 * 2 * slot})
    why = staging_shortfall(short, engine, step)
    assert why is not None
    assert f"backend.local_size={4 * 2 * slot}" in why
    assert "stages 4 chunk(s)" in why
    assert f"at least {5 * 2 * slot} bytes" in why
    assert (
        staging_shortfall(_config({"kind": "lmcache_mp", "local_size": 5 * 2 * slot}), engine, step) is None
    )
    mooncake = _config({"kind": "mooncake_store", "local_size": 2 * slot})
    assert "backend.local_size" in (staging_shortfall(mooncake, engine, step) or "")
    # one group of a hybrid model: the size asked for stages a step of every group (the others take as
    # much again here), and no warning once it is set
    grouped = attrs.evolve(engine, sibling_block_bytes=engine.host_block_bytes)
    why = staging_shortfall(short, grouped, step)
    assert why is not None
    assert f"at least {5 * 2 * 2 * slot} bytes" in why
    assert (
        staging_shortfall(_config({"kind": "lmcache_mp", "local_size": 5 * 2 * 2 * slot}), grouped, step)
        is None
    )


def test_kv_cache_groups_share_the_host_memory_with_as_many_slots_each() -> None:
    # a hybrid model's group of 2 layers beside groups of 6 more layers: each group gets the slots that
    # the memory buys for a chunk of every group
    engine = _engine()
    siblings = attrs.evolve(engine, sibling_block_bytes=3 * engine.host_block_bytes)
    one_chunk = CHUNK * engine.host_block_bytes // BLOCK
    config = _config({"kind": "cpu", "size": 40 * one_chunk})
    assert pool_slots(config, engine) == 40
    assert pool_slots(config, siblings) == 10
    with pytest.raises(ConfigError, match=r"one chunk of 64 tokens of every KV-cache group"):
        pool_slots(_config({"kind": "cpu", "size": 3 * one_chunk}), siblings)
