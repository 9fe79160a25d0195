"""Faults on either side: incompatible peers, unreachable peers, a side that dies, aborts, duplicates,
failed writes.

The protocol faults run over both transports (``peers``). A side that dies runs in a subprocess
(``SIDE``, over a real transfer engine), killed with SIGKILL: no goodbye reaches its peer. A failed
write is injected into the in-memory transport.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import attrs
import pytest
import torch
import zmq

from kvcore.config import PDConfig
from kvcore.errors import BackendUnavailable, IncompatibleLayoutError
from kvcore.model.layout import LayoutKind
from kvcore.ports import PeerTransport
from kvcore.testing.support import start_owned
from kvcore_mooncake.pd import FreeReason, PDConsumer, PDProducer
from kvcore_mooncake.pd.messages import Ack, Notice
from kvcore_mooncake.pd.side_channel import SideChannelClient
from tests.mooncake_pd.conftest import (
    BLOCK_TOKENS,
    CONSUMER_BLOCKS,
    FAST,
    HEAD_SIZE,
    LAYERS,
    PRODUCER_BLOCKS,
    SENTINEL,
    MemoryPeers,
    MooncakePeers,
    Peers,
    SimRank,
    make_rank,
    new_transfer_id,
    wait_for,
)

SRC, DST = (1, 2, 3), (4, 5, 6)
FAST_FIELDS = attrs.asdict(FAST)

SIDE = f"""
import sys, time
import numpy as np
from kvcore.config import PDConfig
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore_mooncake.pd import MooncakePeerTransport, PDConsumer, PDProducer, RankSpec
role, peer, transfer = sys.argv[1:4]
blocks = {PRODUCER_BLOCKS} if role == "producer" else {CONSUMER_BLOCKS}
layout = KVLayout(LayoutKind.VLLM_CPU, blocks, {BLOCK_TOKENS}, 2, {HEAD_SIZE}, 2)
storage = np.full(({LAYERS}, layout.nbytes // 2), {SENTINEL}, dtype=np.int16)
bases = [storage[i].ctypes.data for i in range({LAYERS})]
spec = RankSpec("prefill" if role == "producer" else "decode", "tiny", "bfloat16", 1, 0, 2, layout, bases)
config = PDConfig(**{FAST_FIELDS!r})
side = (PDProducer if role == "producer" else PDConsumer)(spec, MooncakePeerTransport.open(config), config)
print(side.start(), flush=True)
if role == "consumer":
    side.receive(transfer, [peer], {SRC!r}, {DST!r})
time.sleep(60)
"""


def rank(peers: Peers, role: str, *, model: str = "tiny", heads: int = 2) -> SimRank:
    blocks = PRODUCER_BLOCKS if role == "prefill" else CONSUMER_BLOCKS
    return make_rank(
        peers, engine_id=role, kind=LayoutKind.VLLM_CPU, total_heads=heads, tp=1, rank=0, blocks=blocks,
        model=model,
    )  # fmt: skip


@contextlib.contextmanager
def pair_on(
    transports: Sequence[PeerTransport], producer: SimRank, consumer: SimRank, config: PDConfig = FAST
) -> Iterator[tuple[PDProducer, PDConsumer]]:
    """A started producer and consumer on ``transports`` (two of them, in that order)."""
    p, c = PDProducer(producer.spec, transports[0], config), PDConsumer(consumer.spec, transports[1], config)
    p.start()
    c.start()
    try:
        yield p, c
    finally:
        c.close()
        p.close()


def pair(
    peers: Peers, producer: SimRank, consumer: SimRank
) -> contextlib.AbstractContextManager[tuple[PDProducer, PDConsumer]]:
    return pair_on(peers.take(2), producer, consumer)


@contextlib.contextmanager
def side_process(
    role: str, peer: str = "-", transfer: str = "-"
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    process = start_owned(
        [sys.executable, "-c", SIDE, role, peer, transfer],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    try:
        assert process.stdout is not None
        address = process.stdout.readline().strip()
        assert address.startswith("tcp://"), f"the {role} did not start"
        yield process, address
    finally:
        process.kill()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def test_fingerprint_mismatch_is_refused_before_any_byte_moves(peers: Peers) -> None:
    consumer = rank(peers, "decode", model="other-model")
    before = consumer.storage.clone()
    with pair(peers, rank(peers, "prefill"), consumer) as (p, c):
        with pytest.raises(
            IncompatibleLayoutError, match="model differs: producer 'tiny', consumer 'other-model'"
        ):
            c.connect([p.address])
        p.offer("t", SRC)
        c.receive("t", [p.address], SRC, DST)
        (result,) = wait_for("received", c.poll, 1)
    assert (result.ok, result.failed_blocks) == (False, DST)
    assert "model differs" in (result.error or "")
    assert torch.equal(consumer.storage, before)


def test_heads_that_differ_are_refused_with_every_difference(peers: Peers) -> None:
    with (
        pair(peers, rank(peers, "prefill", heads=2), rank(peers, "decode", heads=1)) as (p, c),
        pytest.raises(IncompatibleLayoutError, match="total_kv_heads differs: producer 2, consumer 1"),
    ):
        c.connect([p.address])


def test_producer_addresses_must_name_every_rank_in_order(peers: Peers) -> None:
    with (
        pair(peers, rank(peers, "prefill"), rank(peers, "decode")) as (p, c),
        pytest.raises(
            IncompatibleLayoutError, match="is prefill rank 0 of TP 1; expected prefill rank 0 of TP 2"
        ),
    ):
        c.connect([p.address, p.address])


def test_unreachable_producer_fails_the_transfer_within_the_retries(peers: Peers) -> None:
    with pair(peers, rank(peers, "prefill"), rank(peers, "decode")) as (_, c):
        dead = "tcp://127.0.0.1:9"  # nothing listens on the discard port inside the namespace
        start = time.monotonic()
        with pytest.raises(BackendUnavailable, match="no reply"):
            c.connect([dead])
        c.receive("t", [dead], SRC, DST)
        (result,) = wait_for("received", c.poll, 1)
        elapsed = time.monotonic() - start
    assert (result.ok, result.failed_blocks) == (False, DST)
    # two attempts of 0.5 s each, twice (connect, receive), plus back-off
    assert elapsed < 4 * FAST.handshake_timeout_s + 1.0


def test_unreachable_transfer_engine_fails_the_write_at_once(mooncake: MooncakePeers) -> None:
    (transport,) = mooncake.take(1)
    region = rank(mooncake, "prefill").spec.regions[0]
    transport.register([region])
    start = time.monotonic()
    job = transport.submit_write_columns("127.0.0.1:9", [region.address], [region.address], [64])
    (result,) = transport.wait([job], 5.0)
    assert (result.ok, result.failed) == (False, (0,))
    assert time.monotonic() - start < 2.0


def test_producer_that_dies_makes_the_consumer_report_failed_blocks(mooncake: MooncakePeers) -> None:
    consumer = rank(mooncake, "decode")
    with side_process("producer") as (process, address):
        (transport,) = mooncake.take(1)
        c = PDConsumer(consumer.spec, transport, FAST)
        c.start()
        try:
            c.connect([address])
            process.send_signal(signal.SIGKILL)
            process.wait(10)
            start = time.monotonic()
            c.receive("t", [address], SRC, DST)
            (result,) = wait_for("received", c.poll, 1)
        finally:
            c.close()
    assert (result.ok, result.failed_blocks) == (False, DST)
    assert time.monotonic() - start < FAST.abort_timeout_s + 1.0


def test_producer_that_dies_after_accepting_the_pull_times_out_on_the_consumer(
    mooncake: MooncakePeers,
) -> None:
    consumer = rank(mooncake, "decode")
    with side_process("producer") as (process, address):
        c = PDConsumer(consumer.spec, mooncake.take(1)[0], FAST)
        c.start()
        try:
            start = time.monotonic()
            c.receive("t", [address], SRC, DST)  # accepted and parked: the producer never offers
            time.sleep(0.3)
            process.send_signal(signal.SIGKILL)
            (result,) = wait_for("received", c.poll, 1, timeout=FAST.abort_timeout_s + 3)
        finally:
            c.close()
    assert (result.ok, result.failed_blocks) == (False, DST)
    assert "no completion after" in (result.error or "")
    assert time.monotonic() - start >= FAST.abort_timeout_s


def test_consumer_that_dies_mid_transfer_is_freed_after_the_abort_timeout(mooncake: MooncakePeers) -> None:
    transfer = new_transfer_id()
    producer = rank(mooncake, "prefill")
    p = PDProducer(producer.spec, mooncake.take(1)[0], FAST)
    p.start()
    try:
        with side_process("consumer", p.address, transfer) as (process, _):
            wait_for("pull", lambda: [1] if p.waiting() else [], 1)
            process.send_signal(signal.SIGKILL)
            process.wait(10)
        start = time.monotonic()
        p.offer(transfer, SRC)  # the write and its notice go to a dead consumer
        (freed,) = wait_for("freed", p.poll_freed, 1, timeout=FAST.abort_timeout_s + 5)
        elapsed = time.monotonic() - start
    finally:
        p.close()
    assert freed.reason is FreeReason.TIMED_OUT
    assert FAST.abort_timeout_s - 0.1 <= elapsed


def test_abort_on_either_side_is_idempotent_and_frees_once(peers: Peers) -> None:
    with pair(peers, rank(peers, "prefill"), rank(peers, "decode")) as (p, c):
        # consumer aborts before the producer offered: its release waits for the offer, then frees it
        c.receive("a", [p.address], SRC, DST)
        wait_for("pull", lambda: [1] if p.waiting() else [], 1)
        c.abort("a")
        c.abort("a")
        wait_for("release", lambda: [1] if p.waiting() == 2 else [], 1)  # the pull and the release
        p.offer("a", SRC)
        # producer aborts: later pulls are refused, and the consumer reports failure
        p.offer("b", SRC)
        p.abort("b")
        p.abort("b")
        c.receive("b", [p.address], SRC, DST)
        results = wait_for("received", c.poll, 2)
        freed = wait_for("freed", p.poll_freed, 2)
        time.sleep(0.1)
        assert c.poll() == ()
        assert p.poll_freed() == ()
    assert [(r.transfer_id, r.ok) for r in results] == [("a", False), ("b", False)]
    assert "aborted" in (results[1].error or "")
    assert sorted((f.transfer_id, f.reason) for f in freed) == [
        ("a", FreeReason.DELIVERED),
        ("b", FreeReason.ABORTED),
    ]


def test_a_pull_that_its_offer_refuses_fails_when_the_offer_comes(peers: Peers) -> None:
    consumer = rank(peers, "decode")
    before = consumer.storage.clone()
    with pair(peers, rank(peers, "prefill"), consumer) as (p, c):
        c.receive("t", [p.address], (1, 2, 9), DST)  # block 9 is not offered
        wait_for("pull", lambda: [1] if p.waiting() else [], 1)
        start = time.monotonic()
        p.offer("t", SRC)
        (result,) = wait_for("received", c.poll, 1)
        elapsed = time.monotonic() - start
    assert (result.ok, result.failed_blocks) == (False, DST)
    assert "blocks [9] are not part of transfer 't'" in (result.error or "")
    assert elapsed < FAST.abort_timeout_s / 2
    assert torch.equal(consumer.storage, before)


def test_duplicate_and_stray_notices_are_acknowledged_and_ignored(peers: Peers) -> None:
    consumer = rank(peers, "decode")
    with pair(peers, rank(peers, "prefill"), consumer) as (p, c):
        p.offer("t", SRC)
        c.receive("t", [p.address], SRC, DST)
        (result,) = wait_for("received", c.poll, 1)
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        client = SideChannelClient(context, 1.0, 0)
        try:
            replies = [
                client.request(c.address, Notice("t", "prefill", 0, ok)) for ok in (True, False, True)
            ] + [client.request(c.address, Notice("never-seen", "prefill", 0, True))]
        finally:
            client.close()
            context.term()
        time.sleep(0.05)
        assert c.poll() == ()
    assert result.ok
    assert replies == [Ack()] * 4


def test_a_failed_write_fails_the_transfer_and_frees_once_the_consumer_answered(memory: MemoryPeers) -> None:
    transports = memory.take(2)
    with pair_on(transports, rank(memory, "prefill"), rank(memory, "decode")) as (p, c):
        transports[0].fail_next(1)
        p.offer("t", SRC)
        c.receive("t", [p.address], SRC, DST)
        (result,) = wait_for("received", c.poll, 1)
        (freed,) = wait_for("freed", p.poll_freed, 1)
    assert (result.ok, result.failed_blocks) == (False, DST)
    assert freed.reason is FreeReason.DELIVERED
