"""EngineSpec refuses what does not describe one engine: wrong types, unknown dtypes, fields that disagree."""

from __future__ import annotations

import re

import attrs
import pytest

from kvcore.errors import ConfigError, InvalidSpecError, UnsupportedConfiguration
from kvcore.model.engine import KV_DTYPE_SIZES, EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind

LAYOUT = KVLayout(
    LayoutKind.FLASH_INFER, num_blocks=8, block_tokens=16, num_kv_heads=4, head_size=8, dtype_size=2
)


def spec(**changes: object) -> EngineSpec:
    fields: dict[str, object] = {
        "model_id": "m",
        "kv_dtype": "bfloat16",
        "num_layers": 2,
        "total_kv_heads": 4,
        "layout": LAYOUT,
        "tp_size": 1,
    }
    return EngineSpec(**{**fields, **changes})  # type: ignore[arg-type]  # arbitrary on purpose


def test_a_consistent_spec_is_accepted() -> None:
    engine = spec(total_kv_heads=8, tp_size=2)
    assert engine.host_block_bytes == 2 * LAYOUT.block_bytes


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layout": attrs.asdict(LAYOUT)}, r"EngineSpec.layout: got \{'kind': .*, expected a KVLayout"),
        ({"model_id": 7}, r"EngineSpec.model_id: got 7, expected a non-empty str"),
        ({"model_id": ""}, r"EngineSpec.model_id: got '', expected a non-empty str"),
        (
            {"kv_dtype": b"bfloat16"},
            r"EngineSpec.kv_dtype: got b'bfloat16', expected one of bfloat16, float16",
        ),
        ({"kv_dtype": "half"}, r"EngineSpec.kv_dtype: got 'half'"),
        ({"kv_dtype": "torch.bfloat16"}, r"EngineSpec.kv_dtype: got 'torch.bfloat16'"),
        ({"kv_dtype": "auto"}, r"EngineSpec.kv_dtype: got 'auto'"),
    ],
    ids=["dict-layout", "int-model", "empty-model", "bytes-dtype", "alias", "prefixed", "auto"],
)
def test_wrong_types_and_unknown_dtypes_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        spec(**changes)


@pytest.mark.parametrize("name", ["num_layers", "total_kv_heads", "tp_size"])
@pytest.mark.parametrize("value", [1.0, True, "2", None, 0, -1, 2**62 + 1], ids=repr)
def test_int_fields_refuse_non_ints_bools_and_out_of_range(name: str, value: object) -> None:
    with pytest.raises(
        InvalidSpecError, match=rf"^EngineSpec\.{name}: got {re.escape(repr(value))}, expected an int"
    ):
        spec(**{name: value})


@pytest.mark.parametrize(("dtype", "size"), sorted(KV_DTYPE_SIZES.items()))
def test_dtype_size_is_the_size_of_kv_dtype(dtype: str, size: int) -> None:
    assert spec(kv_dtype=dtype, layout=attrs.evolve(LAYOUT, dtype_size=size)).kv_dtype == dtype
    wrong = 3 if size != 3 else 1
    with pytest.raises(
        InvalidSpecError,
        match=rf"layout.dtype_size is {wrong}, but kv_dtype '{dtype}' has {size}-byte elements",
    ):
        spec(kv_dtype=dtype, layout=attrs.evolve(LAYOUT, dtype_size=wrong))


@pytest.mark.parametrize(
    ("total", "tp", "per_rank"),
    [(4, 1, 4), (8, 2, 4), (8, 8, 1), (2, 4, 1), (1, 8, 1)],
    ids=["one-rank", "split", "one-each", "replicated", "one-head"],
)
def test_a_rank_holds_total_over_tp_heads_or_one_replicated(total: int, tp: int, per_rank: int) -> None:
    layout = attrs.evolve(LAYOUT, num_kv_heads=per_rank)
    assert spec(total_kv_heads=total, tp_size=tp, layout=layout).layout.num_kv_heads == per_rank
    other = per_rank + 1
    with pytest.raises(
        InvalidSpecError,
        match=rf"num_kv_heads is {other}, but total_kv_heads {total} over tp_size {tp} gives {per_rank} head",
    ):
        spec(total_kv_heads=total, tp_size=tp, layout=attrs.evolve(LAYOUT, num_kv_heads=other))


def test_mla_holds_one_latent_on_every_rank() -> None:
    mla = KVLayout(LayoutKind.MLA, num_blocks=8, block_tokens=16, num_kv_heads=1, head_size=576, dtype_size=2)
    assert spec(layout=mla, total_kv_heads=1, tp_size=4).layout is mla


def test_heads_that_no_rank_split_fits_are_unsupported() -> None:
    with pytest.raises(
        UnsupportedConfiguration, match="6 KV heads cannot be split evenly across tensor-parallel size 4"
    ):
        spec(total_kv_heads=6, tp_size=4, layout=attrs.evolve(LAYOUT, num_kv_heads=1))


def test_every_layer_together_is_at_most_2_62_bytes() -> None:
    big = attrs.evolve(LAYOUT, num_blocks=2**40)  # 2**51 bytes a layer: fine alone
    assert spec(layout=big, num_layers=2**11).num_layers == 2**11
    with pytest.raises(InvalidSpecError, match=r"num_layers 4096 x layout.nbytes .* at most 2\*\*62"):
        spec(layout=big, num_layers=2**12)


def test_blocks_per_chunk_is_refused_for_chunks_of_partial_blocks() -> None:
    engine = spec()
    assert engine.blocks_per_chunk(64) == 4
    expected = "expected a multiple of the engine's block size 16"
    for chunk in (24, 8, 0, -16, 64.0, True):
        with pytest.raises(ConfigError, match=rf"^chunk_tokens: got {re.escape(repr(chunk))}, {expected}"):
            engine.blocks_per_chunk(chunk)  # type: ignore[arg-type]
