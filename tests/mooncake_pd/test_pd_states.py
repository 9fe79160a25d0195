"""A hybrid SSM model's pages between TP sizes, through real transfer engines and the in-memory transport:
each page holds an attention layer's K and V (a block of an attention group) or a recurrent state (a block
of a state group, split over ranks in parts, ``kvcore.model.state_plan``). Every consumer rank must hold
its heads of the pulled KV blocks and its slice of every part of the pulled states, byte for byte, and
nothing else may change."""

from __future__ import annotations

import zlib

import attrs
import pytest
import torch

from kvcore.config import PDConfig
from kvcore.errors import IncompatibleLayoutError
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.state_plan import StateLayout, StatePart
from kvcore_mooncake.pd import FreeReason, RankSpec
from kvcore_mooncake.pd.handshake import check_pair
from tests.mooncake_pd.conftest import (
    BLOCK_TOKENS,
    CONSUMER_BLOCKS,
    HEAD_SIZE,
    LAYERS,
    PRODUCER_BLOCKS,
    Peers,
    SimRank,
    new_transfer_id,
    wait_for,
)
from tests.mooncake_pd.test_pd_grid import started

KV_HEADS = 2
# a Gated DeltaNet layer's state in vLLM's "SD" order: 3 time steps of Q, K and V channels (bf16), then
# the recurrent state of 4 value heads (fp32, 8 x 8)
STATE = StateLayout("gdn-sim", [StatePart(8, 2), StatePart(8, 2), StatePart(16, 2)] * 3 + [StatePart(4, 256)])
HEAD_BYTES = BLOCK_TOKENS * 2 * HEAD_SIZE * 2  # one head's K and V of a block (vLLM CPU, 2-byte elements)
KV_SRC, KV_DST = (7, 2, 3), (0, 5, 6)
STATE_SRC, STATE_DST = (4, 11), (9, 1)
UNTOUCHED = 0xAB


def content(block: int, layer: int, what: str, index: int, length: int) -> bytes:
    """The bytes of one global head or state part of a producer block: different everywhere."""
    seed = zlib.crc32(f"{block}/{layer}/{what}/{index}".encode()) & 0xFFFF
    return bytes((seed + 7 * i) % 251 for i in range(length))


def rank_bytes(tp: int, rank: int, block: int, layer: int, state: bool) -> bytes:
    """A rank's share of a request block (``block``: the producer's id): its heads, or its state slices."""
    if not state:
        per = KV_HEADS // tp
        return b"".join(
            content(block, layer, "kv", h, HEAD_BYTES) for h in range(rank * per, (rank + 1) * per)
        )
    return b"".join(
        content(block, layer, "state", index, part.units * part.unit_bytes)[
            first * part.unit_bytes : stop * part.unit_bytes
        ]
        for index, (part, _, first, stop) in enumerate(STATE.slices(tp, rank))
    )


def make_page_rank(peers: Peers, engine_id: str, tp: int, rank: int, blocks: int) -> tuple[SimRank, int]:
    """A rank whose layers' pages hold an attention block (heads at the page's start) or a state."""
    attention = KVLayout(LayoutKind.VLLM_CPU, blocks, BLOCK_TOKENS, KV_HEADS // tp, HEAD_SIZE, 2)
    page = max(attention.block_bytes, STATE.rank_bytes(tp)) + 64  # vLLM pads pages to one size
    layout = KVLayout(
        LayoutKind.VLLM_CPU, blocks, BLOCK_TOKENS, KV_HEADS // tp, HEAD_SIZE, 2, page_bytes=page
    )
    flat, address = peers.memory(LAYERS * blocks * page)
    flat.fill_(UNTOUCHED)
    bases = [address + layer * blocks * page for layer in range(LAYERS)]
    spec = RankSpec(engine_id, "tiny-ssm", "bfloat16", tp, rank, KV_HEADS, layout, bases, STATE)
    return SimRank(spec, flat), page


def put(sim: SimRank, page: int, layer: int, block: int, data: bytes) -> None:
    start = (layer * sim.spec.layout.num_blocks + block) * page
    sim.storage[start : start + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 2), (1, 1)])
def test_consumer_ranks_hold_their_heads_and_their_state_slices(peers: Peers, p: int, d: int) -> None:
    producers = [make_page_rank(peers, "prefill", p, r, PRODUCER_BLOCKS) for r in range(p)]
    consumers = [make_page_rank(peers, "decode", d, r, CONSUMER_BLOCKS) for r in range(d)]
    for sim, page in producers:
        for layer in range(LAYERS):
            for blocks, state in ((KV_SRC, False), (STATE_SRC, True)):
                for block in blocks:
                    put(sim, page, layer, block, rank_bytes(p, sim.spec.tp_rank, block, layer, state))
    expected = []
    for sim, page in consumers:
        want = torch.full_like(sim.storage, UNTOUCHED)
        shadow = SimRank(sim.spec, want)
        for layer in range(LAYERS):
            for srcs, dsts, state in ((KV_SRC, KV_DST, False), (STATE_SRC, STATE_DST, True)):
                for src, dst in zip(srcs, dsts, strict=True):
                    put(shadow, page, layer, dst, rank_bytes(d, sim.spec.tp_rank, src, layer, state))
        expected.append(want)
    transfer = new_transfer_id()
    config = PDConfig(abort_timeout_s=10.0)
    with started(peers, [s for s, _ in producers], [s for s, _ in consumers], config) as (ps, cs):
        addresses = [producer.address for producer in ps]
        for producer in ps:
            producer.offer(transfer, KV_SRC + STATE_SRC)
        for consumer in cs:
            consumer.receive(transfer, addresses, KV_SRC, KV_DST, STATE_SRC, STATE_DST)
        received = [wait_for("received", consumer.poll, 1)[0] for consumer in cs]
        freed = [wait_for("freed", producer.poll_freed, 1)[0] for producer in ps]
    assert [(r.ok, r.error) for r in received] == [(True, None)] * d
    assert {(f.transfer_id, f.reason) for f in freed} == {(transfer, FreeReason.DELIVERED)}
    for (sim, _), want in zip(consumers, expected, strict=True):
        assert torch.equal(sim.storage, want), f"P {p} -> D {d}: consumer rank {sim.spec.tp_rank}"


def test_states_that_cannot_be_exchanged_are_refused_at_handshake(peers: Peers) -> None:
    (producer, _), (consumer, _) = (
        make_page_rank(peers, side, tp, 0, 8) for side, tp in (("p", 1), ("d", 2))
    )
    plain = RankSpec(**{**attrs.asdict(consumer.spec, recurse=False), "state": None})
    with pytest.raises(IncompatibleLayoutError, match="state differs: producer 'gdn-sim', consumer ''"):
        check_pair(producer.spec, plain)
    other = StateLayout("gdn-sim", [StatePart(8, 2), StatePart(4, 256)])
    with pytest.raises(IncompatibleLayoutError, match="state_parts differs"):
        check_pair(producer.spec, RankSpec(**{**attrs.asdict(consumer.spec, recurse=False), "state": other}))
    odd = StateLayout("gdn-sim", [StatePart(3, 2)])
    with pytest.raises(IncompatibleLayoutError, match="part 0 has 3 units, which 2 ranks cannot share"):
        RankSpec(**{**attrs.asdict(consumer.spec, recurse=False), "state": odd})


def test_a_pull_that_names_blocks_the_plans_cannot_serve_is_refused(peers: Peers) -> None:
    from kvcore.errors import InvalidSpecError
    from kvcore_mooncake.pd.messages import Pull

    (producer, _), (consumer, _) = (
        make_page_rank(peers, side, tp, 0, 8) for side, tp in (("p", 1), ("d", 2))
    )
    plans = check_pair(producer.spec, consumer.spec)
    columns = plans.columns(0, Pull("t", "d", 0, (1,), (2,), (3,), (4,)))
    assert columns is not None
    assert len(columns) == 1 + 10  # a head run, and ten state runs (one per part)
    with pytest.raises(InvalidSpecError, match="named for KV and for a state"):
        plans.columns(0, Pull("t", "d", 0, (1,), (2,), (3,), (2,)))
    with pytest.raises(InvalidSpecError, match="outside"):
        plans.columns(0, Pull("t", "d", 0, (), (), (3,), (99,)))
    plain = [
        RankSpec(**{**attrs.asdict(one.spec, recurse=False), "state": None}) for one in (producer, consumer)
    ]
    with pytest.raises(InvalidSpecError, match="state blocks named for a model without recurrent states"):
        check_pair(*plain).columns(0, Pull("t", "d", 0, (), (), (3,), (4,)))
