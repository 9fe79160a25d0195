"""Transfer plans between prefill TP = P and decode TP = D: pairings, block templates, materialized ranges,
and every refusal with its message. Byte figures are worked out by hand in the comments."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcore.errors import IncompatibleLayoutError, InvalidSpecError
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.transfer_plan import CopyColumns, RangeCopy, TPSide, TransferPlan, plan_transfer

CPU, FA, FI, MLA = LayoutKind.VLLM_CPU, LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER, LayoutKind.MLA
NHD, HND = HeadOrder.NHD, HeadOrder.HND


def side(
    tp: int,
    heads: int,
    kind: LayoutKind = FA,
    order: HeadOrder = HND,
    *,
    blocks: int = 8,
    tokens: int = 4,
    head_size: int = 8,
    dtype_size: int = 2,
    layers: int = 2,
    packing: str = "",
) -> TPSide:
    # defaults: one head of one token is 16 bytes, one head of one block (HND) 64 bytes
    local = 1 if kind is MLA else max(1, heads // tp)
    layout = KVLayout(kind, blocks, tokens, local, head_size, dtype_size, head_order=order, packing=packing)
    return TPSide(tp, layout, heads, layers)


def pairings(plan: TransferPlan) -> list[tuple[int, int, int, int]]:
    return [(p.producer_rank, p.consumer_rank, p.head_start, p.head_stop) for p in plan.pairs]


def shortest_range(plan: TransferPlan) -> int:
    """The shortest range any pair copies (before merging across blocks)."""
    return min(copy.length for pair in plan.pairs for copy in pair.block_copies)


# -- pairings and block templates ------------------------------------------------------------------------


def test_same_tp_and_layout_copies_whole_segments() -> None:
    # H=8, TP 2 -> 2: rank r to rank r, 4 heads = 256-byte segments; V plane at 8 blocks * 256 = 2048
    plan = plan_transfer(side(2, 8), side(2, 8))
    assert pairings(plan) == [(0, 0, 0, 4), (1, 1, 4, 8)]
    assert plan.pairs[0].block_copies == (RangeCopy(0, 0, 256), RangeCopy(2048, 2048, 256))
    assert shortest_range(plan) == 256
    assert plan.num_layers == 2


def test_smaller_producer_tp_splits_each_producer_rank_over_consumers() -> None:
    # H=8, TP 2 -> 4: consumer 3 holds heads [6, 8) = producer 1's local heads [2, 4)
    plan = plan_transfer(side(2, 8), side(4, 8))
    assert pairings(plan) == [(0, 0, 0, 2), (0, 1, 2, 4), (1, 2, 4, 6), (1, 3, 6, 8)]
    # src: 2 heads * 64 = 128 bytes into the K segment, and into the V plane at 2048; dst: whole segments
    # (consumer segment 128 bytes, V plane at 8 * 128 = 1024)
    assert plan.pairs[3].block_copies == (RangeCopy(128, 0, 128), RangeCopy(2176, 1024, 128))
    assert shortest_range(plan) == 128


def test_larger_producer_tp_gathers_several_producers_into_one_consumer() -> None:
    # H=8, TP 4 -> 2: consumer 0 reads heads [0, 2) from producer 0 and [2, 4) from producer 1
    plan = plan_transfer(side(4, 8), side(2, 8))
    assert [(p.producer_rank, p.head_start) for p in plan.pairs_for_consumer(0)] == [(0, 0), (1, 2)]
    # producer 1's whole segments (128 bytes, V plane at 1024) land 128 bytes into the consumer's segments
    # (consumer V plane at 8 * 256 = 2048)
    assert plan.pairs_for_consumer(0)[1].block_copies == (RangeCopy(0, 128, 128), RangeCopy(1024, 2176, 128))
    assert [p.consumer_rank for p in plan.pairs_for_producer(3)] == [1]


def test_replicated_producer_heads_are_read_once_spread_over_replicas() -> None:
    # H=2, TP 8 -> 4: head 0 lives on producers 0-3, head 1 on 4-7; consumers 0, 1 hold head 0, 2, 3 head 1
    plan = plan_transfer(side(8, 2), side(4, 2))
    assert pairings(plan) == [(0, 0, 0, 1), (1, 1, 0, 1), (6, 2, 1, 2), (7, 3, 1, 2)]
    assert plan.pairs_for_producer(2) == ()  # an unused replica sends nothing


def test_one_consumer_reads_each_replicated_head_from_one_producer() -> None:
    # H=4, TP 8 -> 1: head h lives on producers 2h and 2h+1; consumer 0 reads each head once
    plan = plan_transfer(side(8, 4), side(1, 4))
    assert pairings(plan) == [(0, 0, 0, 1), (2, 0, 1, 2), (4, 0, 2, 3), (6, 0, 3, 4)]


def test_replicated_consumer_heads_each_read_the_whole_producer_slice() -> None:
    # H=2, TP 2 -> 8: consumers 0-3 hold head 0 (producer 0), 4-7 head 1 (producer 1); 64-byte segments
    plan = plan_transfer(side(2, 2), side(8, 2))
    assert [p.producer_rank for p in plan.pairs] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(p.block_copies == (RangeCopy(0, 0, 64), RangeCopy(512, 512, 64)) for p in plan.pairs)


def test_mla_consumers_read_round_robin_from_producers() -> None:
    # MLA, TP 2 -> 4: everyone holds the whole latent (4 tokens * 576 * 2 = 4608 bytes a block)
    plan = plan_transfer(side(2, 1, MLA, head_size=576), side(4, 1, MLA, head_size=576))
    assert [(p.producer_rank, p.consumer_rank) for p in plan.pairs] == [(0, 0), (1, 1), (0, 2), (1, 3)]
    assert plan.pairs[2].block_copies == (RangeCopy(0, 0, 4608),)


def test_vllm_cpu_moves_whole_head_regions() -> None:
    # H=4, TP 1 -> 2, vLLM CPU: a head region (K and V) is 4 tokens * 16 * 2 = 128 bytes; producer 0's
    # heads [2, 4) are bytes [256, 512) of its 512-byte block, the consumer's whole 256-byte block
    plan = plan_transfer(side(1, 4, CPU), side(2, 4, CPU))
    assert plan.pairs_for_consumer(1)[0].block_copies == (RangeCopy(256, 0, 256),)


def test_flash_attn_and_flash_infer_exchange_segment_by_segment() -> None:
    # H=2, TP 1 -> 1, HND: FlashAttention's V plane starts at 8 * 128 = 1024, FlashInfer's V right after K
    plan = plan_transfer(side(1, 2, FA), side(1, 2, FI))
    assert plan.pairs[0].block_copies == (RangeCopy(0, 0, 128), RangeCopy(1024, 128, 128))


@pytest.mark.parametrize(
    ("p", "d", "heads"),
    [(2, 2, 8), (2, 4, 2), (4, 8, 1)],
    ids=["same-tp", "both-replicated", "one-head"],
)
def test_nhd_is_fine_when_both_sides_hold_the_same_heads_per_rank(p: int, d: int, heads: int) -> None:
    # every pair copies all local heads on both sides: whole segments, no per-token runs
    plan = plan_transfer(side(p, heads, FI, NHD), side(d, heads, FI, NHD))
    assert all(len(pair.block_copies) == 1 for pair in plan.pairs)


# -- materialize ------------------------------------------------------------------------------------------


def test_consecutive_blocks_merge_into_one_run_per_plane() -> None:
    # TP 2 -> 2, FlashAttention: blocks [2, 3, 4] -> [5, 6, 7], 256-byte segments: one K and one V run
    plan = plan_transfer(side(2, 8), side(2, 8))
    assert plan.materialize(plan.pairs[0], [2, 3, 4], [5, 6, 7]) == (
        RangeCopy(512, 1280, 768),
        RangeCopy(2560, 3328, 768),
    )


def test_flash_infer_whole_blocks_merge_across_k_and_v() -> None:
    # TP 1 -> 1, FlashInfer, 2 heads: a block is 256 bytes (K then V) and is copied as one range;
    # [4, 5, 1] -> [0, 1, 7]: blocks 4, 5 merge, block 1 stands alone
    plan = plan_transfer(side(1, 2, FI), side(1, 2, FI))
    assert plan.pairs[0].block_copies == (RangeCopy(0, 0, 256),)
    assert plan.materialize(plan.pairs[0], [4, 5, 1], [0, 1, 7]) == (
        RangeCopy(1024, 0, 512),
        RangeCopy(256, 1792, 256),
    )


def test_partial_heads_give_one_range_per_block_and_segment() -> None:
    # TP 2 -> 4: consumer 3's 128-byte slices of blocks [1, 2] -> [3, 4]; K ranges first, then V
    plan = plan_transfer(side(2, 8), side(4, 8))
    assert plan.materialize(plan.pairs[3], [1, 2], [3, 4]) == (
        RangeCopy(384, 384, 128),
        RangeCopy(640, 512, 128),
        RangeCopy(2432, 1408, 128),
        RangeCopy(2688, 1536, 128),
    )


def test_materialize_columns_gives_the_same_copies_as_columns() -> None:
    plan = plan_transfer(side(2, 8), side(4, 8))
    columns = plan.materialize_columns(plan.pairs[0], [0, 5], [1, 2])
    assert tuple(columns) == plan.materialize(plan.pairs[0], [0, 5], [1, 2])
    assert len(columns) == 4
    assert sum(columns.lengths) == 4 * 128
    assert plan.materialize(plan.pairs[0], [], []) == ()


def test_materialize_refuses_bad_block_lists() -> None:
    plan = plan_transfer(side(2, 8), side(2, 8))
    pair = plan.pairs[0]
    with pytest.raises(InvalidSpecError, match="2 source blocks but 1 destination"):
        plan.materialize(pair, [0, 1], [0])
    with pytest.raises(InvalidSpecError, match=r"source block 8 is outside \[0, 8\)"):
        plan.materialize(pair, [8], [0])
    with pytest.raises(InvalidSpecError, match=r"destination block -1 is outside"):
        plan.materialize(pair, [0], [-1])
    with pytest.raises(InvalidSpecError, match="destination block appears twice"):
        plan.materialize(pair, [0, 1], [3, 3])
    other = plan_transfer(side(2, 8), side(4, 8))
    with pytest.raises(InvalidSpecError, match="does not belong to this transfer plan"):
        plan.materialize(other.pairs[1], [0], [0])


def test_ranks_outside_the_tp_size_are_refused() -> None:
    plan = plan_transfer(side(2, 8), side(4, 8))
    with pytest.raises(InvalidSpecError, match=r"rank 4 is outside \[0, 4\)"):
        plan.pairs_for_consumer(4)
    with pytest.raises(InvalidSpecError, match=r"rank -1 is outside \[0, 2\)"):
        plan.pairs_for_producer(-1)


def test_copy_columns_must_have_equal_lengths() -> None:
    with pytest.raises(InvalidSpecError, match="same length"):
        CopyColumns((0, 1), (0,), (4, 4))


@st.composite
def plans_and_blocks(draw: st.DrawFn) -> tuple[TransferPlan, int, list[int], list[int]]:
    kind = draw(st.sampled_from([CPU, FA, FI]))
    p, d = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    plan = plan_transfer(
        side(p, 4, kind, blocks=6, tokens=2, head_size=2, dtype_size=1),
        side(d, 4, kind, blocks=5, tokens=2, head_size=2, dtype_size=1),
    )
    count = draw(st.integers(0, 5))
    src = draw(st.lists(st.integers(0, 5), min_size=count, max_size=count))
    dst = draw(st.permutations(range(5)))[:count]
    return plan, draw(st.integers(0, len(plan.pairs) - 1)), src, dst


@given(plans_and_blocks())
def test_merged_ranges_move_the_same_bytes_as_the_template_block_by_block(
    case: tuple[TransferPlan, int, list[int], list[int]],
) -> None:
    # the naive expansion (template shifted per block) and the merged ranges map the same bytes
    plan, index, src_blocks, dst_blocks = case
    pair = plan.pairs[index]
    src_stride, dst_stride = plan.producer.layout.block_stride, plan.consumer.layout.block_stride
    naive = [
        RangeCopy(c.src_offset + s * src_stride, c.dst_offset + d * dst_stride, c.length)
        for s, d in zip(src_blocks, dst_blocks, strict=True)
        for c in pair.block_copies
    ]
    merged = plan.materialize(pair, src_blocks, dst_blocks)

    def byte_map(copies: tuple[RangeCopy, ...] | list[RangeCopy]) -> set[tuple[int, int]]:
        return {(c.src_offset + k, c.dst_offset + k) for c in copies for k in range(c.length)}

    assert byte_map(merged) == byte_map(naive)
    assert len(merged) <= len(naive)


# -- refusals ---------------------------------------------------------------------------------------------


def test_heads_that_split_neither_way_are_refused() -> None:
    # 6 heads over TP 4: neither 6 % 4 nor 4 % 6 is 0
    with pytest.raises(IncompatibleLayoutError, match="total_kv_heads=6 and tp_size=4: neither divides"):
        TPSide(4, KVLayout(FA, 8, 4, 1, 8, 2), 6, 2)


def test_a_layout_holding_the_wrong_head_count_is_refused() -> None:
    with pytest.raises(
        IncompatibleLayoutError, match="gives 2 heads per rank, but the layout holds num_kv_heads=4"
    ):
        TPSide(4, KVLayout(FA, 8, 4, 4, 8, 2), 8, 2)


def test_an_mla_side_has_one_latent_head() -> None:
    with pytest.raises(IncompatibleLayoutError, match="one latent KV head per layer, got total_kv_heads=2"):
        TPSide(1, KVLayout(MLA, 8, 4, 1, 8, 2), 2, 2)


@pytest.mark.parametrize(
    ("producer", "consumer", "message"),
    [
        pytest.param(
            side(2, 8),
            side(2, 8, tokens=16),
            "block_tokens differs: producer 4, consumer 16",
            id="block_tokens",
        ),
        pytest.param(
            side(2, 8), side(2, 8, head_size=16), "head_size differs: producer 8, consumer 16", id="head_size"
        ),
        pytest.param(
            side(2, 8),
            side(2, 8, dtype_size=1),
            "dtype_size differs: producer 2, consumer 1",
            id="dtype_size",
        ),
        pytest.param(
            side(1, 4, CPU),
            side(1, 4, FA),
            "layout kind differs: producer vllm_cpu, consumer flash_attn",
            id="kind",
        ),
        pytest.param(
            side(1, 4, LayoutKind.PAGED),
            side(1, 4, CPU),
            "layout kind differs: producer paged, consumer vllm_cpu",
            id="paged-vs-cpu",
        ),
        pytest.param(
            side(2, 8, CPU, packing="amx"),
            side(2, 8, CPU, packing="vec"),
            "packing differs: producer amx, consumer vec",
            id="packing",
        ),
        pytest.param(
            side(1, 1, MLA),
            side(1, 1, FA),
            r"MLA and non-MLA KV cannot be exchanged \(producer mla",
            id="mla",
        ),
        pytest.param(
            side(2, 8, FA, NHD), side(2, 8), "head order differs: producer nhd, consumer hnd", id="head_order"
        ),
        pytest.param(
            side(2, 8), side(2, 4), "total_kv_heads differs: producer 8, consumer 4", id="total_kv_heads"
        ),
        pytest.param(
            side(2, 8), side(2, 8, layers=3), "num_layers differs: producer 2, consumer 3", id="num_layers"
        ),
    ],
)
def test_sides_that_differ_are_refused_naming_the_difference(
    producer: TPSide, consumer: TPSide, message: str
) -> None:
    with pytest.raises(IncompatibleLayoutError, match=message):
        plan_transfer(producer, consumer)


def test_heterogeneous_tp_with_nhd_is_refused() -> None:
    # H=8, TP 2 -> 4, NHD: 2 heads * 16 bytes = 32-byte runs per token
    with pytest.raises(
        IncompatibleLayoutError,
        match=r"heterogeneous TP needs the HND layout: .* one 32-byte run per token",
    ):
        plan_transfer(side(2, 8, FI, NHD), side(4, 8, FI, NHD))


def test_every_difference_is_named_at_once() -> None:
    with pytest.raises(IncompatibleLayoutError, match=r"block_tokens differs.*dtype_size differs"):
        plan_transfer(side(2, 8), side(2, 8, tokens=8, dtype_size=1))
