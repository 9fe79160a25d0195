"""KV layouts: shapes, strides, segments and head runs, computed by hand for each engine layout."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import InvalidSpecError
from kvcore.model.layout import ByteRange, HeadOrder, KVLayout, LayoutKind

CPU, FA, FI, MLA = LayoutKind.VLLM_CPU, LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER, LayoutKind.MLA
PG = LayoutKind.PAGED
NHD, HND = HeadOrder.NHD, HeadOrder.HND


def layout(kind: LayoutKind, order: HeadOrder = HND, heads: int = 4) -> KVLayout:
    # 4 blocks of 16 tokens, head 8 in 2-byte elements: one head of one token is 16 bytes
    return KVLayout(
        kind, num_blocks=4, block_tokens=16, num_kv_heads=heads, head_size=8, dtype_size=2, head_order=order
    )


def test_vllm_cpu_slices_whole_head_regions() -> None:
    # [4 blocks, 2 heads, 16 tokens, 2*8]: a head region (K and V) is 16 * 16 * 2 = 512 bytes
    cpu = layout(CPU, heads=2)
    assert cpu.shape == cpu.physical_shape == (4, 2, 16, 16)
    assert cpu.strides == (512, 256, 16, 1)
    assert (cpu.segments_per_block, cpu.block_bytes, cpu.block_stride, cpu.nbytes) == (1, 1024, 1024, 4096)
    assert cpu.segments(1) == (ByteRange(1024, 1024),)
    # head 1 of block 1 -> the second half of that block
    assert cpu.head_runs(1, 1, 2) == (ByteRange(1536, 512),)


def test_flash_attn_nhd_has_a_k_plane_and_a_v_plane_and_runs_per_token() -> None:
    # [2, 4 blocks, 16 tokens, 4 heads, 8]: a segment is 16 * 4 * 16 = 1024 bytes, the V plane starts at 4096
    fa = layout(FA, NHD)
    assert fa.shape == fa.physical_shape == (2, 4, 16, 4, 8)
    assert (fa.block_bytes, fa.block_stride, fa.head_stride, fa.nbytes) == (2048, 1024, 16, 8192)
    assert fa.segments(2) == (ByteRange(2048, 1024), ByteRange(6144, 1024))
    # heads [1, 3) of block 2: per token t, 32 bytes at segment + t * 64 + 16; K tokens then V tokens
    runs = fa.head_runs(2, 1, 3)
    assert len(runs) == 2 * 16
    assert runs[:2] == (ByteRange(2064, 32), ByteRange(2128, 32))
    assert runs[16] == ByteRange(6160, 32)


def test_flash_attn_hnd_gives_one_run_per_segment() -> None:
    # physical [2, 4 blocks, 4 heads, 16 tokens, 8]; the engine's shape keeps NHD order with permuted strides
    fa = layout(FA, HND)
    assert fa.shape == (2, 4, 16, 4, 8)
    assert fa.physical_shape == (2, 4, 4, 16, 8)
    assert fa.strides == (2048, 512, 8, 128, 1)
    assert fa.head_stride == 256
    # heads [1, 3) of block 2 -> one 512-byte run in the K plane, one in the V plane
    assert fa.head_runs(2, 1, 3) == (ByteRange(2304, 512), ByteRange(6400, 512))


@pytest.mark.parametrize("order", [NHD, HND])
def test_flash_infer_keeps_k_then_v_inside_each_block(order: HeadOrder) -> None:
    # [4 blocks, 2, ...]: block 1 is bytes [2048, 4096), K first
    fi = layout(FI, order)
    assert fi.shape == (4, 2, 16, 4, 8)
    assert fi.block_stride == fi.block_bytes == 2048
    assert fi.segments(1) == (ByteRange(2048, 1024), ByteRange(3072, 1024))


def test_flash_infer_hnd_strides_and_head_runs() -> None:
    fi = layout(FI, HND)
    assert fi.physical_shape == (4, 2, 4, 16, 8)
    assert fi.strides == (1024, 512, 8, 128, 1)
    # head 3 of block 1: the last 256 bytes of each segment
    assert fi.head_runs(1, 3, 4) == (ByteRange(2816, 256), ByteRange(3840, 256))


def test_paged_nhd_is_vllm_lbnhc_with_k_then_v_per_head_and_token() -> None:
    # logical [4 blocks, 4 heads, 16 tokens, 2*8]; memory [blocks, tokens, heads, K|V]: one head of one
    # token is 32 bytes, K then V
    pg = layout(PG, NHD)
    assert pg.shape == (4, 4, 16, 16)
    assert pg.physical_shape == (4, 16, 4, 16)
    assert pg.strides == (1024, 16, 64, 1)
    assert (pg.segments_per_block, pg.block_bytes, pg.head_stride) == (1, 2048, 32)
    # heads [1, 3) of block 1: per token t, 64 bytes at 2048 + t * 128 + 32
    runs = pg.head_runs(1, 1, 3)
    assert len(runs) == 16
    assert runs[:2] == (ByteRange(2080, 64), ByteRange(2208, 64))


def test_paged_hnd_is_vllm_lbhnc_with_one_run_per_head_range() -> None:
    pg = layout(PG, HND)
    assert pg.shape == pg.physical_shape == (4, 4, 16, 16)
    assert pg.strides == (1024, 256, 16, 1)
    assert pg.head_runs(1, 1, 3) == (ByteRange(2560, 1024),)


def test_padded_pages_put_blocks_apart_without_changing_their_bytes_or_name() -> None:
    pg = KVLayout(PG, 4, 16, 4, 8, 2, HND, page_bytes=2560)
    assert (pg.block_bytes, pg.block_stride, pg.nbytes) == (2048, 2560, 4 * 2560)
    assert pg.extent == 3 * 2560 + 2048  # the last page's padding is not the layer's
    assert layout(PG, HND).extent == layout(PG, HND).nbytes
    assert layout(FA, HND).extent == layout(FA, HND).nbytes  # K plane then V plane
    assert pg.strides == (1280, 256, 16, 1)
    assert pg.segments(1) == (ByteRange(2560, 2048),)
    assert pg.head_runs(1, 1, 3) == (ByteRange(3072, 1024),)
    assert pg.name == layout(PG, HND).name
    for bad, message in ((2046, "got 2046, expected a multiple of dtype_size 2 of at least"), (2049, "2049")):
        with pytest.raises(InvalidSpecError, match=message):
            KVLayout(PG, 4, 16, 4, 8, 2, HND, page_bytes=bad)
    with pytest.raises(InvalidSpecError, match="flash_attn has K and V planes, not pages"):
        KVLayout(FA, 4, 16, 4, 8, 2, HND, page_bytes=4096)


def test_each_byte_order_has_its_own_name() -> None:
    # names go into keys and the P/D handshake: equal only for the same bytes in the same order
    layouts = [
        layout(CPU),
        KVLayout(CPU, 4, 16, 4, 8, 2, packing="amx"),
        KVLayout(CPU, 4, 16, 4, 8, 2, packing="vec"),
        layout(PG, NHD),
        layout(PG, HND),
        layout(FA, NHD),
        layout(FA, HND),
        layout(FI, NHD),
        layout(FI, HND),
        KVLayout(MLA, 4, 16, 1, 8, 2),
    ]
    assert len({lay.name for lay in layouts}) == len(layouts)
    assert KVLayout(CPU, 4, 16, 4, 8, 2, packing="amx").name == "vllm_cpu/amx"
    for bad in ("AMX", "a/b", "x" * 33, 3):
        with pytest.raises(InvalidSpecError, match=r"KVLayout\.packing: got"):
            KVLayout(CPU, 4, 16, 4, 8, 2, packing=bad)  # type: ignore[arg-type]  # a wrong type on purpose


def test_mla_is_one_latent_segment_without_head_slicing() -> None:
    # [4 blocks, 16 tokens, latent 576] in 2-byte elements: 18432 bytes a block
    mla = KVLayout(MLA, num_blocks=4, block_tokens=16, num_kv_heads=1, head_size=576, dtype_size=2)
    assert mla.shape == (4, 16, 576)
    assert mla.strides == (9216, 576, 1)
    assert mla.segments(3) == (ByteRange(55296, 18432),)
    assert mla.head_runs(3, 0, 1) == mla.segments(3)
    assert mla.nbytes == 4 * 18432


@pytest.mark.parametrize("kind", [FA, FI])
def test_nhd_full_head_range_is_the_whole_segment(kind: LayoutKind) -> None:
    # every head of every token: the per-token runs touch, so they are the segments themselves
    nhd = layout(kind, NHD)
    assert nhd.head_runs(3, 0, 4) == nhd.segments(3)


@pytest.mark.parametrize(
    ("start", "stop"),
    [(-1, 2), (0, 5), (2, 2), (3, 1)],
    ids=["negative", "past-the-end", "empty", "reversed"],
)
def test_head_range_must_be_a_non_empty_part_of_the_local_heads(start: int, stop: int) -> None:
    with pytest.raises(InvalidSpecError, match=r"is not a non-empty part of \[0, 4\)"):
        layout(FA).head_runs(0, start, stop)


def test_mla_cannot_slice_below_its_one_head() -> None:
    mla = KVLayout(MLA, num_blocks=2, block_tokens=4, num_kv_heads=1, head_size=8, dtype_size=2)
    with pytest.raises(InvalidSpecError, match=r"\[0, 1\)"):
        mla.head_runs(0, 0, 2)


@pytest.mark.parametrize("block", [-1, 4])
def test_block_must_exist(block: int) -> None:
    with pytest.raises(InvalidSpecError, match=rf"block {block} is outside \[0, 4\)"):
        layout(FI).segments(block)


def test_invalid_layouts_are_refused() -> None:
    with pytest.raises(InvalidSpecError, match="num_kv_heads must be 1"):
        KVLayout(MLA, num_blocks=2, block_tokens=4, num_kv_heads=2, head_size=8, dtype_size=2)
    with pytest.raises(InvalidSpecError, match="head_order must be HND"):
        layout(CPU, NHD)
    with pytest.raises(ValueError, match="num_blocks"):
        KVLayout(FA, num_blocks=0, block_tokens=4, num_kv_heads=2, head_size=8, dtype_size=2)


styles = st.sampled_from([(CPU, HND), (PG, NHD), (PG, HND), (FA, NHD), (FA, HND), (FI, NHD), (FI, HND)])
layouts = st.builds(
    lambda style, blocks, tokens, heads, size, dtype: KVLayout(
        style[0], blocks, tokens, heads, size, dtype, head_order=style[1]
    ),
    styles,
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from([1, 2]),
)


@settings(deadline=None)  # timing-free: a loaded shared machine once pushed an example past 200 ms
@given(layouts, st.data())
def test_head_runs_of_a_head_partition_tile_the_tensor(lay: KVLayout, data: st.DataObject) -> None:
    # split the heads in two at a random point: over all blocks the runs cover every byte exactly once
    cut = data.draw(st.integers(1, lay.num_kv_heads))
    parts = [(0, cut), (cut, lay.num_kv_heads)] if cut < lay.num_kv_heads else [(0, cut)]
    covered = [
        byte
        for block in range(lay.num_blocks)
        for start, stop in parts
        for run in lay.head_runs(block, start, stop)
        for byte in range(run.offset, run.stop)
    ]
    assert sorted(covered) == list(range(lay.nbytes))


@settings(deadline=None)
@given(layouts.filter(lambda lay: lay.kind is not CPU), st.data())
def test_strides_locate_the_same_bytes_as_head_runs(lay: KVLayout, data: st.DataObject) -> None:
    # the engine's strides put K or V of (block, token, head) where the segment arithmetic does
    block = data.draw(st.integers(0, lay.num_blocks - 1))
    head = data.draw(st.integers(0, lay.num_kv_heads - 1))
    token = data.draw(st.integers(0, lay.block_tokens - 1))
    kv = data.draw(st.integers(0, 1))
    index: tuple[int, ...]
    if lay.kind is PG:  # K and V side by side in one segment, per head and token
        index, segment, unit = (block, head, token, kv * lay.head_size), lay.segments(block)[0], 2
    else:
        index = (kv, block, token, head, 0) if lay.kind is FA else (block, kv, token, head, 0)
        segment, unit = lay.segments(block)[kv], 1
    offset = sum(i * s for i, s in zip(index, lay.strides, strict=True)) * lay.dtype_size
    in_segment = token * lay.num_kv_heads + head if lay.head_order is NHD else head * lay.block_tokens + token
    head_bytes = lay.head_size * lay.dtype_size
    assert offset == segment.offset + in_segment * unit * head_bytes + (kv * head_bytes if unit == 2 else 0)


# -- refused input: every field named with its value ------------------------------------------------------


def test_kind_and_head_order_take_the_enum_or_its_documented_value() -> None:
    by_value = KVLayout("flash_infer", 4, 16, 4, 8, 2, head_order="nhd")
    assert by_value == layout(FI, NHD)
    assert by_value.kind is FI
    assert by_value.shape == (4, 2, 16, 4, 8)  # FlashInfer's, not MLA's three axes


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"kind": "FLASH_INFER"},
            r"KVLayout.kind: got 'FLASH_INFER', expected a LayoutKind or one of 'vllm_cpu'",
        ),
        ({"kind": "flashinfer"}, r"KVLayout.kind: got 'flashinfer'"),
        ({"kind": 2}, r"KVLayout.kind: got 2, expected a LayoutKind"),
        ({"kind": HND}, r"KVLayout.kind: got <HeadOrder.HND: 'hnd'>"),
        (
            {"head_order": "HND"},
            r"KVLayout.head_order: got 'HND', expected a HeadOrder or one of 'nhd', 'hnd'",
        ),
        ({"head_order": FA}, r"KVLayout.head_order: got <LayoutKind.FLASH_ATTN"),
        ({"head_order": None}, r"KVLayout.head_order: got None"),
    ],
)
def test_enum_fields_refuse_anything_but_their_members_and_values(
    changes: dict[str, object], message: str
) -> None:
    fields: dict[str, object] = {"kind": FA, "num_blocks": 4, "block_tokens": 16, "num_kv_heads": 4}
    with pytest.raises(InvalidSpecError, match=message):
        KVLayout(**{**fields, "head_size": 8, "dtype_size": 2, **changes})  # type: ignore[arg-type]


INT_FIELDS = ["num_blocks", "block_tokens", "num_kv_heads", "head_size", "dtype_size"]


@pytest.mark.parametrize("name", INT_FIELDS)
@pytest.mark.parametrize("value", [2.0, 2.5, True, "2", None, 0, -3, 2**62 + 1], ids=repr)
def test_int_fields_refuse_non_ints_bools_and_out_of_range(name: str, value: object) -> None:
    fields: dict[str, object] = {
        "kind": FA,
        "num_blocks": 4,
        "block_tokens": 16,
        "num_kv_heads": 4,
        "head_size": 8,
        "dtype_size": 2,
    }
    fields[name] = value
    with pytest.raises(
        InvalidSpecError, match=rf"^KVLayout\.{name}: got {re.escape(repr(value))}, expected an int"
    ):
        KVLayout(**fields)  # type: ignore[arg-type]


def test_a_tensor_above_2_62_bytes_is_refused() -> None:
    # each field fits, their product does not: byte offsets would overflow int64 in numpy and torch
    with pytest.raises(
        InvalidSpecError, match=r"KVLayout: num_blocks 1099511627776 x block_bytes .* at most 2\*\*62"
    ):
        KVLayout(FA, num_blocks=2**40, block_tokens=2**10, num_kv_heads=2**4, head_size=2**8, dtype_size=2)


@pytest.mark.parametrize(
    ("offset", "length", "name"),
    [(-1, 4, "offset"), (0.5, 4, "offset"), (0, 0, "length"), (0, True, "length")],
)
def test_byte_ranges_refuse_negative_empty_and_non_int(offset: object, length: object, name: str) -> None:
    with pytest.raises(InvalidSpecError, match=rf"^ByteRange\.{name}: got"):
        ByteRange(offset, length)  # type: ignore[arg-type]


@pytest.mark.parametrize(("block", "start", "stop"), [(1.0, 0, 1), (True, 0, 1), (0, 0.0, 1), (0, 0, 1.5)])
def test_block_and_head_arguments_must_be_ints(block: object, start: object, stop: object) -> None:
    with pytest.raises(InvalidSpecError):
        layout(FA).head_runs(block, start, stop)  # type: ignore[arg-type]
