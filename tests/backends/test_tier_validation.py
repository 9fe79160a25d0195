"""open_rank, pool_slots and slot_bytes refuse a rank, world or chunk size that does not fit the engine,
and tensors that are not what the engine declared, before anything is allocated or divided."""

from __future__ import annotations

import re
import threading

import attrs
import pytest
import torch

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import ConfigError, InvalidSpecError
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.plugins.sizing import pool_slots, slot_bytes
from kvcore_cpu.tier import open_rank

LAYOUT = KVLayout(
    LayoutKind.VLLM_CPU, num_blocks=8, block_tokens=16, num_kv_heads=1, head_size=8, dtype_size=2
)
ENGINE = EngineSpec(
    model_id="m", kv_dtype="bfloat16", num_layers=2, total_kv_heads=2, layout=LAYOUT, tp_size=2
)


def config(chunk_tokens: int = 32) -> KVCoreConfig:
    return load_config({"backend": {"kind": "cpu", "size": "1MiB"}, "chunk_tokens": chunk_tokens})


def kv(dtype: torch.dtype = torch.bfloat16, layers: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.shape, dtype=dtype) for _ in range(layers)]


def test_each_rank_of_the_engine_opens_a_worker() -> None:
    for rank in (0, 1):
        worker = open_rank(config(), ENGINE, kv(), rank=rank, world_size=2)
        assert worker.host is not None
        worker.close()


@pytest.mark.parametrize("rank", [-1, 2, True, 1.0, "0", None], ids=repr)
def test_a_rank_outside_the_world_is_refused(rank: object) -> None:
    with pytest.raises(
        ConfigError, match=rf"^rank: got {re.escape(repr(rank))}, expected an int in \[0, 2\)"
    ):
        open_rank(config(), ENGINE, kv(), rank=rank, world_size=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("world_size", [1, 3, 0, -2, 2.0, True, "2"], ids=repr)
def test_a_world_other_than_the_engines_tp_size_is_refused(world_size: object) -> None:
    expected = rf"^world_size: got {re.escape(repr(world_size))}, expected the engine's tp_size 2"
    with pytest.raises(ConfigError, match=expected):
        open_rank(config(), ENGINE, kv(), rank=0, world_size=world_size)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=expected):
        pool_slots(config(), ENGINE, world_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk_tokens", [8, 24, 40])
def test_chunks_of_partial_blocks_are_refused_before_dividing(chunk_tokens: int) -> None:
    # 8 // 16 would be 0 blocks a chunk: 0-byte slots, a division by zero in pool_slots
    expected = rf"^chunk_tokens: got {chunk_tokens}, expected a multiple of the engine's block size 16"
    with pytest.raises(ConfigError, match=expected):
        slot_bytes(config(chunk_tokens), ENGINE)
    with pytest.raises(ConfigError, match=expected):
        pool_slots(config(chunk_tokens), ENGINE, 2)
    with pytest.raises(ConfigError, match=expected):
        open_rank(config(chunk_tokens), ENGINE, kv(), world_size=2)


def test_tensors_of_another_dtype_than_kv_dtype_are_refused() -> None:
    # float16 has bfloat16's size: only the engine's kv_dtype tells them apart
    with pytest.raises(
        InvalidSpecError,
        match=r"layer 0: dtype: got torch.float16, expected torch.bfloat16 \(the engine's kv_dtype\)",
    ):
        open_rank(config(), ENGINE, kv(torch.float16), world_size=2)


def test_a_layer_count_other_than_the_engines_is_refused() -> None:
    with pytest.raises(InvalidSpecError, match=r"^tensors: got 3 KV tensors, expected 2"):
        open_rank(config(), ENGINE, kv(layers=3), world_size=2)


def test_meta_tensors_are_refused_before_any_host_memory_is_allocated() -> None:
    threads = set(threading.enumerate())
    meta = [torch.empty(LAYOUT.shape, dtype=torch.bfloat16, device="meta") for _ in range(2)]
    with pytest.raises(InvalidSpecError, match=r"layer 0: device: got meta, expected cpu or cuda"):
        open_rank(config(), attrs.evolve(ENGINE, total_kv_heads=1, tp_size=1), meta)
    assert set(threading.enumerate()) == threads  # no mover started
