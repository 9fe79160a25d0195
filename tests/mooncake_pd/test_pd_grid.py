"""Every (P, D) pairing and KV head count, through real transfer engines and through the in-memory
transport: consumer ranks must hold exactly their heads of the producer's KV, byte for byte, and every
producer rank must free its blocks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kvcore.config import PDConfig
from kvcore.model.layout import HeadOrder, LayoutKind
from kvcore_mooncake.pd import FreeReason, PDConsumer, PDProducer
from tests.mooncake_pd.conftest import (
    CONSUMER_BLOCKS,
    PRODUCER_BLOCKS,
    Peers,
    SimRank,
    expected_consumer,
    fill_producer,
    global_kv,
    make_rank,
    new_transfer_id,
    wait_for,
)

PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
HEADS = [1, 2, 8]
KINDS = [LayoutKind.VLLM_CPU, LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER]
GRID = [(kind, p, d) for kind in KINDS for p, d in PAIRS] + [
    (LayoutKind.PAGED, p, d)
    for p, d in [(1, 2), (4, 1)]  # vLLM CPU's runs, K|V per token: two pairs do
]
SRC_BLOCKS = (7, 2, 3, 4, 11)  # a run of three in the middle: merged copies and single ones
DST_BLOCKS = (0, 5, 6, 7, 9)


@contextlib.contextmanager
def started(
    peers: Peers, producers: list[SimRank], consumers: list[SimRank], config: PDConfig
) -> Iterator[tuple[list[PDProducer], list[PDConsumer]]]:
    transports = peers.take(len(producers) + len(consumers))
    ps = [PDProducer(sim.spec, t, config) for sim, t in zip(producers, transports, strict=False)]
    cs = [PDConsumer(sim.spec, t, config) for sim, t in zip(consumers, transports[len(ps) :], strict=True)]
    try:
        for producer in ps:
            producer.start()
        for consumer in cs:
            consumer.start()
        yield ps, cs
    finally:
        for consumer in cs:
            consumer.close()
        for producer in ps:
            producer.close()
        for transport in transports:
            transport.close()


CROSS_LAYER = [  # vLLM's BL* orders on one side or both: (kind, p, d, producer's, consumer's)
    (LayoutKind.PAGED, 1, 2, True, False),
    (LayoutKind.PAGED, 2, 1, False, True),
    (LayoutKind.FLASH_INFER, 2, 4, True, True),
]


@pytest.mark.parametrize(("kind", "p", "d"), GRID, ids=lambda x: x.value if isinstance(x, LayoutKind) else x)
def test_consumer_ranks_hold_their_head_slices(peers: Peers, kind: LayoutKind, p: int, d: int) -> None:
    check_pairing(peers, kind, p, d)


@pytest.mark.parametrize(
    ("kind", "p", "d", "cross_producer", "cross_consumer"),
    CROSS_LAYER,
    ids=lambda x: x.value if isinstance(x, LayoutKind) else str(x),
)
def test_cross_layer_blocks_pair_with_per_layer_blocks(
    peers: Peers, kind: LayoutKind, p: int, d: int, cross_producer: bool, cross_consumer: bool
) -> None:
    # every layer's block of a block together (interleaved layers, registered as one region): each side's
    # own layout places the bytes, so consumer ranks hold exactly their heads whatever the other side's
    check_pairing(peers, kind, p, d, (cross_producer, cross_consumer))


def check_pairing(
    peers: Peers, kind: LayoutKind, p: int, d: int, cross: tuple[bool, bool] = (False, False)
) -> None:
    """Every head count: consumers hold their heads of the producers' KV; ``cross``: which side's layers
    interleave block by block (producer's, consumer's)."""
    for heads in HEADS:
        producers, consumers = (
            [
                make_rank(
                    peers,
                    engine_id=side,
                    kind=kind,
                    total_heads=heads,
                    tp=tp,
                    rank=r,
                    blocks=blocks,
                    cross_layer=interleaved,
                )
                for r in range(tp)
            ]
            for side, tp, blocks, interleaved in (
                ("prefill", p, PRODUCER_BLOCKS, cross[0]),
                ("decode", d, CONSUMER_BLOCKS, cross[1]),
            )
        )
        kv = global_kv(kind, heads, len(SRC_BLOCKS), seed=heads * 100 + p * 10 + d)
        for sim in producers:
            fill_producer(sim, kv, SRC_BLOCKS)
        transfer = new_transfer_id()
        with started(peers, producers, consumers, PDConfig(abort_timeout_s=10.0)) as (ps, cs):
            addresses = [producer.address for producer in ps]
            for producer in ps:
                producer.offer(transfer, SRC_BLOCKS)
            for consumer in cs:
                consumer.receive(transfer, addresses, SRC_BLOCKS, DST_BLOCKS)
            received = [wait_for("received", consumer.poll, 1)[0] for consumer in cs]
            freed = [wait_for("freed", producer.poll_freed, 1)[0] for producer in ps]
        assert [(r.transfer_id, r.ok, r.error) for r in received] == [(transfer, True, None)] * d
        assert {(f.transfer_id, f.reason) for f in freed} == {(transfer, FreeReason.DELIVERED)}
        for sim in consumers:
            expected = expected_consumer(sim, kv, DST_BLOCKS)
            assert torch.equal(sim.storage, expected), f"heads={heads} consumer rank {sim.spec.tp_rank}"


def test_nhd_layout_with_heterogeneous_tp_is_refused_at_handshake(peers: Peers) -> None:
    # NHD: a consumer rank's heads would be one small run per token: the plan refuses, before any byte
    producer = make_rank(
        peers, engine_id="prefill", kind=LayoutKind.FLASH_ATTN, total_heads=8, tp=1, rank=0,
        blocks=PRODUCER_BLOCKS, order=HeadOrder.NHD,
    )  # fmt: skip
    consumer = make_rank(
        peers, engine_id="decode", kind=LayoutKind.FLASH_ATTN, total_heads=8, tp=2, rank=0,
        blocks=CONSUMER_BLOCKS, order=HeadOrder.NHD,
    )  # fmt: skip
    before = consumer.storage.clone()
    with started(peers, [producer], [consumer], PDConfig()) as (ps, cs):
        ps[0].offer("t", SRC_BLOCKS)
        cs[0].receive("t", [ps[0].address], SRC_BLOCKS, DST_BLOCKS)
        (result,) = wait_for("received", cs[0].poll, 1)
    assert not result.ok
    assert result.failed_blocks == DST_BLOCKS
    assert "heterogeneous TP needs the HND layout" in (result.error or "")
    assert torch.equal(consumer.storage, before)
