"""State transfer plans between TP sizes: every consumer rank's state, rebuilt from the producer ranks'
pages by the plan's copies, is its own slice of every part, byte for byte; and every refusal by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import IncompatibleLayoutError, InvalidSpecError
from kvcore.model.state_plan import StateLayout, StatePart, plan_state_transfer
from kvcore.model.transfer_plan import RangeCopy

BLOCKS, TOKENS, LAYERS = 6, 4, 2


def gdn(key: int = 8, value: int = 16, rows: int = 3, heads: int = 4) -> StateLayout:
    # a Gated DeltaNet state in vLLM's "SD" order: each time step's Q, K, V channels (2-byte elements),
    # then the recurrent state of each value head (64 bytes a head)
    conv = [StatePart(key, 2), StatePart(key, 2), StatePart(value, 2)] * rows
    return StateLayout("gdn-test", [*conv, StatePart(heads, 64)])


def pages(state: StateLayout, tp: int, pad: int) -> int:
    return state.rank_bytes(tp) + pad


def global_bytes(state: StateLayout, block: int) -> list[bytes]:
    """Every part's bytes over all ranks, different in every block and part."""
    return [
        bytes((block * 31 + index * 7 + i) % 251 for i in range(part.units * part.unit_bytes))
        for index, part in enumerate(state.parts)
    ]


def rank_page(state: StateLayout, tp: int, rank: int, block: int) -> bytes:
    return b"".join(
        data[first * part.unit_bytes : stop * part.unit_bytes]
        for (part, _, first, stop), data in zip(
            state.slices(tp, rank), global_bytes(state, block), strict=True
        )
    )


@settings(max_examples=60, deadline=None)
@given(
    producer_tp=st.sampled_from([1, 2, 4]),
    consumer_tp=st.sampled_from([1, 2, 4]),
    key=st.sampled_from([4, 8, 16]),
    heads=st.sampled_from([4, 8]),
    rows=st.integers(1, 3),
    pads=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    blocks=st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=BLOCKS, unique=True),
)
def test_every_consumer_rank_gets_its_slice_of_every_part(
    producer_tp: int,
    consumer_tp: int,
    key: int,
    heads: int,
    rows: int,
    pads: tuple[int, int],
    blocks: list[int],
) -> None:
    state = gdn(key=key, value=2 * key, rows=rows, heads=heads)
    src_page, dst_page = (
        pages(state, tp, 16 * pad) for tp, pad in zip((producer_tp, consumer_tp), pads, strict=True)
    )
    plan = plan_state_transfer(
        state,
        state.side(producer_tp, BLOCKS, TOKENS, src_page, LAYERS),
        state.side(consumer_tp, BLOCKS, TOKENS, dst_page, LAYERS),
    )
    producers = [
        b"".join(rank_page(state, producer_tp, rank, b).ljust(src_page, b"\xee") for b in range(BLOCKS))
        for rank in range(producer_tp)
    ]
    dst_blocks = [BLOCKS - 1 - b for b in blocks]  # elsewhere on the consumer
    for consumer_rank in range(consumer_tp):
        memory = bytearray(b"\x00" * dst_page * BLOCKS)
        pairs = plan.pairs_for_consumer(consumer_rank)
        assert pairs, consumer_rank
        for pair in pairs:
            for copy in plan.materialize(pair, blocks, dst_blocks):
                source = producers[pair.producer_rank]
                memory[copy.dst_offset : copy.dst_offset + copy.length] = source[
                    copy.src_offset : copy.src_offset + copy.length
                ]
        for src, dst in zip(blocks, dst_blocks, strict=True):
            expected = rank_page(state, consumer_tp, consumer_rank, src)
            assert memory[dst * dst_page : dst * dst_page + len(expected)] == expected
            rest = memory[dst * dst_page + len(expected) : (dst + 1) * dst_page]
            assert rest == bytes(len(rest))  # a page's padding is never written


def test_tp1_to_tp2_copies_each_parts_half_and_merges_touching_parts() -> None:
    # one rank of TP 1 holds Q 8 channels (16 bytes), V 16 (32 bytes), then 4 heads of 64 bytes; a TP 2
    # rank holds half of each: 8, 16, then 2 heads (128 bytes)
    state = StateLayout("s", [StatePart(8, 2), StatePart(16, 2), StatePart(4, 64)])
    plan = plan_state_transfer(
        state, state.side(1, BLOCKS, TOKENS, 304, LAYERS), state.side(2, BLOCKS, TOKENS, 152, LAYERS)
    )
    assert [(p.producer_rank, p.consumer_rank) for p in plan.pairs] == [(0, 0), (0, 1)]
    assert plan.pairs[0].block_copies == (RangeCopy(0, 0, 8), RangeCopy(16, 8, 16), RangeCopy(48, 24, 128))
    assert plan.pairs[1].block_copies == (RangeCopy(8, 0, 8), RangeCopy(32, 8, 16), RangeCopy(176, 24, 128))
    # TP 2 -> TP 1: each consumer part gathers both ranks' halves
    back = plan_state_transfer(
        state, state.side(2, BLOCKS, TOKENS, 152, LAYERS), state.side(1, BLOCKS, TOKENS, 304, LAYERS)
    )
    assert [(p.producer_rank, p.consumer_rank) for p in back.pairs] == [(0, 0), (1, 0)]
    # the same TP size copies the whole state as one range
    same = plan_state_transfer(
        state, state.side(2, BLOCKS, TOKENS, 152, LAYERS), state.side(2, BLOCKS, TOKENS, 152, LAYERS)
    )
    assert same.pairs[1].block_copies == (RangeCopy(0, 0, 152),)


def test_what_cannot_be_exchanged_is_refused_by_name() -> None:
    state = gdn()
    with pytest.raises(IncompatibleLayoutError, match="part 0 has 8 units, which 16 ranks cannot share"):
        state.rank_bytes(16)
    other = StateLayout("gdn-other", state.parts)
    with pytest.raises(IncompatibleLayoutError, match="is not state gdn-test at TP 2") as info:
        plan_state_transfer(
            state, other.side(1, BLOCKS, TOKENS, 1024, LAYERS), other.side(2, BLOCKS, TOKENS, 1024, 3)
        )
    assert "num_layers differs: producer 2, consumer 3" in str(info.value)
    with pytest.raises(IncompatibleLayoutError, match="block_tokens differs: producer 4, consumer 8"):
        plan_state_transfer(
            state, state.side(1, BLOCKS, TOKENS, 1024, LAYERS), state.side(2, BLOCKS, 8, 1024, LAYERS)
        )
    with pytest.raises(InvalidSpecError, match=r"StateLayout\.name: got 'Bad Name'"):
        StateLayout("Bad Name", state.parts)
    with pytest.raises(InvalidSpecError, match="page_bytes"):
        state.side(1, BLOCKS, TOKENS, 8, LAYERS)  # a page smaller than the state
    with pytest.raises(InvalidSpecError, match=r"StateLayout.parts: got \(\), expected one StatePart"):
        StateLayout("s", [])
    with pytest.raises(InvalidSpecError, match="unit_bytes"):
        StatePart(4, 0)
    with pytest.raises(InvalidSpecError, match=r"StateLayout\.parts: got 5"):
        StateLayout("s", 5)  # type: ignore[arg-type]  # what an untyped caller may pass
