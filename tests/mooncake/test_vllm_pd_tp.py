"""Disaggregated prefill/decode between real vLLM engines of different TP sizes (CPU build, tiny model with
four KV heads): a TP-1 engine and a TP-2 engine, both ``kv_both``, so each direction needs no third
engine. TP 1 prefills, TP 2 decodes: each decode rank pulls its two heads out of the producer's four.
TP 2 prefills, TP 1 decodes: the decode rank pulls heads 0-1 from producer rank 0 and 2-3 from rank 1.

What must be equal is the bytes moved: every head of every layer of the prompt's full blocks on each
decode rank equals that head of the producer rank that holds it (read out of band on both engines),
and every decode rank reports its receive done. Tokens cannot be compared like with like across TP
sizes (bf16 rounds differently: the decode engine computes the last prompt token and the answer on top
of KV rounded by the other TP size), so only the first generated token is compared, with the
producer's own prefix hit of the same prompt (every full block cached, the last token computed).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from attrs import frozen

from tests.integration.conftest import (  # the shared vLLM fixtures and helpers
    BLOCK,
    VLLM_MARKS,
    generate,
    prompt,
    stop_engine,
    tiny_model,
    vllm_env,
)
from tests.integration.tp2 import (
    TP,
    ReceiveRecord,
    head_digests_probe,
    kv_heads_model,
    rank_heads,
    receive_probe,
    record_receives_probe,
    start_tp_engine,
    tokens_of,
)
from tests.mooncake.conftest import free_port, patient_transfers

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS

KV_HEADS = 4
PROMPT_BLOCKS = 3  # full blocks, then one token: the one the decode engine computes itself


@frozen
class Engine:
    llm: Any
    tp: int
    name: str


def _ports(count: int) -> int:
    """A free port followed by ``count - 1`` more free ones (producer rank ``r`` listens on ``port + r``)."""
    while True:
        port = free_port()
        try:
            for extra in range(1, count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + extra))
        except OSError:
            continue
        return port


def _pd_config(engine_id: str, port: int) -> dict[str, Any]:
    # generous: the engines share two cores with the test run's other lane, whose engines busy-poll
    pd = {"port": port, "handshake_timeout_s": 20.0, "handshake_retries": 3, "abort_timeout_s": 120.0}
    return {
        "kv_connector": "KVCorePDConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pd": pd},
    }


@pytest.fixture(scope="module")
def engines(vllm_env: Path) -> Iterator[dict[int, Engine]]:
    """One engine of each TP size on the same model, both producers and consumers."""
    model = kv_heads_model(vllm_env, KV_HEADS)
    started: list[Engine] = []
    try:
        for tp in (1, TP):
            name = f"tp{tp}"
            with patient_transfers():
                llm = start_tp_engine(model, KV_HEADS, _pd_config(name, _ports(tp)), tp=tp)
            started.append(Engine(llm, tp, name))
            assert llm.collective_rpc(record_receives_probe) == list(range(tp))
        yield {engine.tp: engine for engine in started}
    finally:
        for engine in reversed(started):
            stop_engine(engine.llm)


def _by_rank(answers: list[tuple[int, Any]]) -> list[Any]:
    assert [rank for rank, _ in answers] == list(range(len(answers))), answers
    return [value for _, value in answers]


def _handoff(producer: Engine, consumer: Engine, seed: int) -> None:
    tokens = prompt(seed, PROMPT_BLOCKS * BLOCK + 1)
    prefill = generate(producer.llm, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = prefill.kv_transfer_params
    assert params is not None
    assert params["remote_engine_id"] == producer.name
    assert params["remote_tp_size"] == producer.tp
    (src,) = params["remote_block_ids"]
    assert len(src) == PROMPT_BLOCKS + 1
    # the producer holds the prompt's blocks until the consumer pulled them: read every rank's heads now
    held = _by_rank(producer.llm.collective_rpc(head_digests_probe, args=(list(src[:PROMPT_BLOCKS]),)))

    decoded = generate(consumer.llm, tokens, kv_transfer_params=params)
    records: list[ReceiveRecord | None] = _by_rank(
        consumer.llm.collective_rpc(receive_probe, args=(params["transfer_id"],))
    )
    dst: list[int] | None = None
    for rank, record in enumerate(records):
        assert record is not None, f"{consumer.name} rank {rank} was given no receive"
        _, pulled, into, ok = record
        assert ok is True, f"{consumer.name} rank {rank}: the receive did not succeed ({ok})"
        assert pulled == list(src), f"{consumer.name} rank {rank} pulled {pulled}, the prompt is in {src}"
        assert dst is None or into == dst, f"the decode ranks received into different blocks: {records}"
        dst = into
    assert dst is not None
    got = _by_rank(consumer.llm.collective_rpc(head_digests_probe, args=(dst[:PROMPT_BLOCKS],)))

    # head h of layer l, block j, as the producer rank holding it has it
    want = {
        head: [[blocks[j][k] for j in range(PROMPT_BLOCKS)] for blocks in layers]
        for rank, layers in enumerate(held)
        for k, head in enumerate(rank_heads(KV_HEADS, producer.tp, rank))
    }
    assert sorted(want) == list(range(KV_HEADS))
    for rank, layers in enumerate(got):
        heads = rank_heads(KV_HEADS, consumer.tp, rank)
        for k, head in enumerate(heads):
            have = [[blocks[j][k] for j in range(PROMPT_BLOCKS)] for blocks in layers]
            assert have == want[head], f"{consumer.name} rank {rank} head {head} differs from the producer's"

    local = generate(producer.llm, tokens)  # the producer's own prefix hit: full blocks cached
    assert local.num_cached_tokens == PROMPT_BLOCKS * BLOCK
    assert tokens_of(decoded)[0] == tokens_of(local)[0]


def test_tp1_prefill_tp2_decode(engines: dict[int, Engine]) -> None:
    _handoff(engines[1], engines[TP], seed=7101)


def test_tp2_prefill_tp1_decode(engines: dict[int, Engine]) -> None:
    _handoff(engines[TP], engines[1], seed=7202)
