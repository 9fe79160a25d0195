"""Brute-force check of transfer plans against a logical model of KV bytes, over every small TP pairing.

Each producer rank's KV is simulated as bytes in its layout, every element naming (layer, request block,
K/V, global head, token, element); the plan is applied with shuffled and with consecutive block ids; each
consumer rank must then hold exactly its heads' elements where the model (written here independently of
``kvcore``'s byte arithmetic) puts them, and nothing anywhere else.
"""

from __future__ import annotations

import itertools
import random

import pytest

from kvcore.errors import IncompatibleLayoutError
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.transfer_plan import TPSide, plan_transfer

TOKENS, HEAD, DTYPE, REQUEST_BLOCKS, LAYERS = 2, 2, 2, 3, 2
PRODUCER_BLOCKS, CONSUMER_BLOCKS = 5, 4  # different sizes, so a stride taken from the wrong side shows
UNWRITTEN = 0xFFFF  # consumer bytes no copy may touch
STALE = 0xFFFE  # producer blocks outside the request

CPU, FA, FI, MLA = LayoutKind.VLLM_CPU, LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER, LayoutKind.MLA
NHD, HND = HeadOrder.NHD, HeadOrder.HND
LAYOUT_STYLES = [(CPU, HND), (FA, NHD), (FA, HND), (FI, NHD), (FI, HND), (MLA, HND)]

Style = tuple[LayoutKind, HeadOrder]


def owned_heads(rank: int, tp: int, total: int) -> range:
    """vLLM's rule: an even split, or one head replicated over tp / total ranks."""
    if total >= tp:
        return range(rank * total // tp, (rank + 1) * total // tp)
    return range(rank // (tp // total), rank // (tp // total) + 1)


def element_index(
    style: Style, blocks: int, heads: int, block: int, *, kv: int, head: int, token: int, elem: int
) -> int:
    """Where an element sits in a layer's tensor, in elements, straight from each layout's shape."""
    kind, order = style
    if kind is MLA:  # [blocks, tokens, latent]
        return (block * TOKENS + token) * HEAD + elem
    if kind is CPU:  # [blocks, heads, tokens, 2*head], K stored transposed ([head, tokens]) then V
        inside = elem * TOKENS + token if kv == 0 else TOKENS * HEAD + token * HEAD + elem
        return (block * heads + head) * TOKENS * 2 * HEAD + inside
    if order is NHD:
        in_segment = (token * heads + head) * HEAD + elem
    else:
        in_segment = (head * TOKENS + token) * HEAD + elem
    segment = TOKENS * heads * HEAD
    plane = kv * blocks + block if kind is FA else block * 2 + kv  # [2, blocks, ...] or [blocks, 2, ...]
    return plane * segment + in_segment


def element_id(layer: int, request_block: int, *, kv: int, head: int, token: int, elem: int) -> int:
    return ((((layer * REQUEST_BLOCKS + request_block) * 2 + kv) * 16 + head) * TOKENS + token) * HEAD + elem


def rank_bytes(
    style: Style, blocks: int, heads: range, layer: int, *, block_ids: list[int], fill: int
) -> bytearray:
    """One rank's layer tensor: the request's elements at ``block_ids``, ``fill`` everywhere else."""
    kv_count, head_count = (1, 1) if style[0] is MLA else (2, len(heads))
    data = bytearray(fill.to_bytes(DTYPE, "little") * (blocks * kv_count * head_count * TOKENS * HEAD))
    for request_block, block in enumerate(block_ids):
        for kv, (local, head), token, elem in itertools.product(
            range(kv_count), enumerate(heads), range(TOKENS), range(HEAD)
        ):
            at = (
                element_index(style, blocks, head_count, block, kv=kv, head=local, token=token, elem=elem)
                * DTYPE
            )
            value = element_id(layer, request_block, kv=kv, head=head, token=token, elem=elem)
            data[at : at + DTYPE] = value.to_bytes(DTYPE, "little")
    return data


def expected_error(producer: Style, consumer: Style, p: int, d: int, heads: int) -> str | None:
    (p_kind, p_order), (c_kind, c_order) = producer, consumer
    if (p_kind is MLA) != (c_kind is MLA):
        return "MLA and non-MLA KV cannot be exchanged"
    if p_kind is MLA:
        return None
    if p_kind is not c_kind and {p_kind, c_kind} != {FA, FI}:
        return "layout kind differs"
    if p_order is not c_order:
        return "head order differs"
    if p_order is NHD and max(1, heads // p) != max(1, heads // d):
        return "heterogeneous TP needs the HND layout"
    return None


def side(style: Style, tp: int, heads: int, blocks: int) -> TPSide:
    total = 1 if style[0] is MLA else heads
    local = len(owned_heads(0, tp, total))
    layout = KVLayout(style[0], blocks, TOKENS, local, HEAD, DTYPE, head_order=style[1])
    return TPSide(tp, layout, total, LAYERS)


def _style_id(style: Style) -> str:
    return f"{style[0].value}-{style[1].value}"


def _cases() -> list[object]:
    cases: list[object] = []
    tps, head_counts = (1, 2, 4, 8), (1, 2, 4, 8, 16)
    for producer, consumer in itertools.product(LAYOUT_STYLES, repeat=2):
        both_mla = producer[0] is MLA and consumer[0] is MLA
        for p, d, heads in itertools.product(tps, tps, (1,) if both_mla else head_counts):
            name = f"{_style_id(producer)}>{_style_id(consumer)}-P{p}-D{d}-H{heads}"
            cases.append(pytest.param(producer, consumer, p, d, heads, id=name))
    return cases


@pytest.mark.parametrize(("producer_style", "consumer_style", "p", "d", "heads"), _cases())
def test_plan_moves_exactly_each_consumers_heads(
    producer_style: Style, consumer_style: Style, p: int, d: int, heads: int
) -> None:
    producer = side(producer_style, p, heads, PRODUCER_BLOCKS)
    consumer = side(consumer_style, d, heads, CONSUMER_BLOCKS)
    error = expected_error(producer_style, consumer_style, p, d, heads)
    if error is not None:
        with pytest.raises(IncompatibleLayoutError, match=error):
            plan_transfer(producer, consumer)
        return
    plan = plan_transfer(producer, consumer)
    by_producer = {pair for rank in range(p) for pair in plan.pairs_for_producer(rank)}
    assert by_producer == {pair for rank in range(d) for pair in plan.pairs_for_consumer(rank)}

    rng = random.Random(f"{producer_style}{consumer_style}{p}{d}{heads}")
    block_lists = [
        ([1, 2, 3], [0, 1, 2]),  # consecutive on both sides: whole-segment copies merge across blocks
        (
            rng.sample(range(PRODUCER_BLOCKS), REQUEST_BLOCKS),
            rng.sample(range(CONSUMER_BLOCKS), REQUEST_BLOCKS),
        ),
    ]
    producer_total = producer.total_kv_heads
    for src_blocks, dst_blocks in block_lists:
        for c in range(d):
            mine = owned_heads(c, d, producer_total)
            pairs = plan.pairs_for_consumer(c)
            for layer in range(LAYERS):
                got = rank_bytes(consumer_style, CONSUMER_BLOCKS, mine, layer, block_ids=[], fill=UNWRITTEN)
                written = 0
                for pair in pairs:
                    source = rank_bytes(
                        producer_style,
                        PRODUCER_BLOCKS,
                        owned_heads(pair.producer_rank, p, producer_total),
                        layer,
                        block_ids=src_blocks,
                        fill=STALE,
                    )
                    for copy in plan.materialize(pair, src_blocks, dst_blocks):
                        got[copy.dst_offset : copy.dst_offset + copy.length] = source[
                            copy.src_offset : copy.src_offset + copy.length
                        ]
                        written += copy.length
                want = rank_bytes(
                    consumer_style, CONSUMER_BLOCKS, mine, layer, block_ids=dst_blocks, fill=UNWRITTEN
                )
                assert got == want, f"consumer {c}, layer {layer}, blocks {src_blocks}->{dst_blocks}"
                # every request byte written once: no replica read twice, no overlap
                assert written == REQUEST_BLOCKS * consumer.layout.block_bytes
