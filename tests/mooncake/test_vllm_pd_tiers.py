"""P/D with tiers: one ``KVCoreConnector`` per engine, a ``pd`` section beside a shared disk tier.

Two real vLLM engines (CPU build, tiny model, TP 1): the prefill engine (``kv_producer``) and the decode
engine (``kv_consumer``) share one disk tier (a host pool in front, the disk written through; chunks of
two blocks, so that a tier can lack a whole block). A two-turn conversation:

- turn 1 goes through P/D: the prefill engine saves the prompt's whole chunks as it computes them, the
  decode engine loads those from the tier and pulls only the blocks after them, then saves what it
  decodes;
- turn 2 (turn 1's prompt, its answer, a new message) finds its history in the tier on the prefill
  engine, which computes only past it; the decode engine takes its own prefix cache, then the tier, and
  pulls from the producer only the blocks neither holds.

A prompt whose every block but the last token's is found locally or in the tier pulls nothing (vLLM
computes the last token anyway). Tokens are compared with vLLM's own prefix hit of the same length. A
decode engine whose producer is gone, or killed mid-transfer (half of the owed block written), still loads
the tier's part and computes the rest; one aborted while both the tier and the producer owe it blocks
leaks nothing. A TP-1 producer and a TP-2 consumer share the tier (a value per KV head) and the pull.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.conftest import (  # the shared vLLM fixtures and helpers
    BLOCK,
    VLLM_MARKS,
    generate,
    prompt,
    start_engine,
    stop_engine,
    tiny_model,
    vllm_env,
)
from tests.integration.probes import (
    die_mid_write,
    engine_metrics,
    external_hits,
    kvcore_metric,
    pulled_blocks,
    shorten_pd_patience,
)
from tests.integration.test_vllm_policies import GAUGES, _settled
from tests.integration.tp2 import TP, kv_heads_model, start_tp_engine, tokens_of
from tests.mooncake.conftest import free_port, patient_transfers

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS

HEADS = 2  # the tiny Llama's KV heads: the disk keeps a file per head of each chunk
CHUNK = 2 * BLOCK  # coarser than vLLM's blocks, as kvcore's default: a tier can lack a whole block


def pd_tiers_config(role: str, engine_id: str, port: int, store: Path) -> dict[str, Any]:
    pd = {"port": port, "handshake_timeout_s": 1.0, "handshake_retries": 1, "abort_timeout_s": 30.0}
    tiers = [
        {"kind": "cpu", "size": "16MiB"},
        {"kind": "disk", "path": str(store), "size": "64MiB", "write": "through"},
    ]
    return {
        "kv_connector": "KVCoreConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "tiers": tiers,
            "chunk_tokens": CHUNK,
            "partial_chunks": "drop",
            "pd": pd,
        },
    }


def _chunks_on_disk(store: Path, heads: int) -> int:
    return sum(1 for path in (store / "chunks").rglob("*") if path.is_file()) // heads


class Disk:
    """The chunks a test added to the shared disk tier: saves are asynchronous, so a test waits for them."""

    def __init__(self, store: Path, heads: int = HEADS) -> None:
        self._store, self._heads = store, heads
        self._before = _chunks_on_disk(store, heads)

    def wait_for(self, count: int, within_s: float = 30.0) -> None:
        """Wait until the test's saves added ``count`` chunks (written through)."""
        deadline = time.monotonic() + within_s
        while (added := _chunks_on_disk(self._store, self._heads) - self._before) < count:
            assert time.monotonic() < deadline, f"{added} chunks added on disk, {count} expected"
            time.sleep(0.05)


def _from_producers(llm: Any) -> int:
    """vLLM's prompt tokens cached by source ``p2p`` so far: what the connector said the producer owed."""
    return sum(
        int(m.value)
        for m in engine_metrics(llm)
        if m.name == "vllm:prompt_tokens_cached_by_source" and m.labels.get("source") == "p2p"
    )


def _pulled(llm: Any) -> int:
    return sum(llm.collective_rpc(pulled_blocks))


def _dead(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (dead, not yet reaped by its parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _tokens(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def _prefill(producer: Any, tokens: list[int]) -> tuple[Any, dict[str, Any]]:
    """The prefill engine's half of a P/D request: its output, and the params for the decode engine."""
    out = generate(producer, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert out.kv_transfer_params is not None
    return out, out.kv_transfer_params


def _owing_block_4(engines: tuple[Any, Any, Path], seed: int) -> tuple[list[int], dict[str, Any]]:
    """A prompt of four blocks and 100 tokens prefilled by the prefill engine, once the tier holds its
    blocks 0..3 (saved as it prefilled them): the producer owes the decode engine block 4. Returns the
    prompt and the params for the decode engine."""
    producer, _, store = engines
    disk = Disk(store)
    tokens = prompt(seed, 4 * BLOCK + 100)
    _, params = _prefill(producer, tokens)
    disk.wait_for(2)
    return tokens, params


@contextlib.contextmanager
def _pair(start: Callable[[str, str, int], Any]) -> Iterator[tuple[Any, Any]]:
    """A prefill and a decode engine (``start(role, engine_id, side-channel port)``), stopped after."""
    with patient_transfers():
        producer = start("kv_producer", "prefill-0", free_port())
    try:
        with patient_transfers():
            consumer = start("kv_consumer", "decode-0", 0)
        try:
            yield producer, consumer
        finally:
            stop_engine(consumer)
    finally:
        stop_engine(producer)


@pytest.fixture(scope="module")
def engines(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Path]]:
    """A prefill and a decode engine over one disk tier, shared by the tests (each its own prompts)."""
    store = tmp_path_factory.mktemp("store")

    def start(role: str, engine_id: str, port: int) -> Any:
        return start_engine(tiny_model, pd_tiers_config(role, engine_id, port, store))

    with _pair(start) as (producer, consumer):
        yield producer, consumer, store


def test_turn_two_finds_its_history_in_the_tier_and_pulls_only_the_rest(
    engines: tuple[Any, Any, Path],
) -> None:
    producer, consumer, store = engines
    disk = Disk(store)
    # turn 1: three whole blocks and one token; the answer fills block 3 (decoded on the consumer only)
    turn1 = prompt(8101, 3 * BLOCK + 1)
    _, params1 = _prefill(producer, turn1)
    assert params1["remote_tier_tokens"] == 0  # a fresh prompt: nothing in the tier
    disk.wait_for(1)  # the producer saved chunk 0 (blocks 0-1) as it prefilled it; block 2 ends no chunk
    before = (_pulled(consumer), external_hits(consumer), _from_producers(consumer))
    decoded1 = generate(consumer, turn1, max_tokens=BLOCK, kv_transfer_params=params1)
    assert _pulled(consumer) - before[0] == 2  # blocks 0-1 came from the tier: only blocks 2-3 are pulled
    assert external_hits(consumer) - before[1] == len(turn1)
    assert _from_producers(consumer) - before[2] == len(turn1) - 2 * BLOCK  # vLLM's hits by source: p2p
    disk.wait_for(2)  # the consumer saved chunk 1 (blocks 2-3): block 3 holds its answer

    # turn 2: the history (block 3 known to the tier only) and a new message, one token past block 6
    history = turn1 + _tokens(decoded1)
    turn2 = history + prompt(8102, 7 * BLOCK + 1 - len(history))
    prefill2, params2 = _prefill(producer, turn2)
    # its own cache held blocks 0..2, the tier block 3: it computed only from block 4 on
    assert prefill2.num_cached_tokens == 4 * BLOCK
    assert params2["remote_tier_tokens"] == BLOCK

    disk.wait_for(3)  # the producer saved chunk 2 (blocks 4-5)
    before = (_pulled(consumer), external_hits(consumer), _from_producers(consumer))
    decoded2 = generate(consumer, turn2, kv_transfer_params=params2)
    # its own cache held blocks 0..3, the tier blocks 4-5: only blocks 6-7 are pulled
    assert _pulled(consumer) - before[0] == 2
    assert external_hits(consumer) - before[1] == len(turn2) - 4 * BLOCK
    assert _from_producers(consumer) - before[2] == len(turn2) - 6 * BLOCK
    reference2 = generate(producer, turn2)  # vLLM's own hit of blocks 0..6, the last token computed
    assert reference2.num_cached_tokens == 7 * BLOCK
    assert _tokens(decoded2) == _tokens(reference2)
    # turn 1's reference last: run earlier, the producer would have computed block 3 itself
    reference1 = generate(producer, turn1, max_tokens=BLOCK)  # vLLM's own hit: 3 blocks, 1 token computed
    assert reference1.num_cached_tokens == 3 * BLOCK
    assert _tokens(decoded1) == _tokens(reference1)


def test_a_producer_gone_costs_only_what_the_tier_lacks(engines: tuple[Any, Any, Path]) -> None:
    producer, consumer = engines[:2]
    tokens, params = _owing_block_4(engines, 8201)
    # the producer's side channel no longer answers (its address names a port nobody listens on)
    gone = {**params, "remote_bootstrap_addr": f"tcp://127.0.0.1:{free_port()}"}
    before = (_pulled(consumer), external_hits(consumer))
    started = time.monotonic()
    decoded = generate(consumer, tokens, kv_transfer_params=gone)
    assert time.monotonic() - started < 20.0
    assert _pulled(consumer) - before[0] == 0
    assert external_hits(consumer) - before[1] == len(tokens)  # counted at admission: tier + producer
    reference = generate(producer, tokens)  # vLLM's own hit of blocks 0..3, block 4 computed: the same split
    assert reference.num_cached_tokens == 4 * BLOCK
    assert _tokens(decoded) == _tokens(reference)
    # the tier's four blocks stayed loaded: a second run hits all of them in the consumer's own cache
    again = generate(consumer, tokens)
    assert again.num_cached_tokens == 4 * BLOCK


def test_a_decode_request_aborted_while_the_tier_and_the_producer_owe_it_leaks_nothing(
    engines: tuple[Any, Any, Path],
) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    producer, consumer = engines[:2]
    tokens, params = _owing_block_4(engines, 8401)
    with socket.socket() as silent:  # a producer that accepts connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        stuck = {
            **params,
            "remote_bootstrap_addr": f"tcp://127.0.0.1:{silent.getsockname()[1]}",
        }
        engine = consumer.llm_engine
        sampling = SamplingParams(temperature=0.0, max_tokens=8, extra_args={"kv_transfer_params": stuck})
        engine.add_request("stuck", TokensPrompt(prompt_token_ids=tokens), sampling)
        time.sleep(0.5)  # its tier load and its pull started; the pull's handshake hangs
        engine.abort_request(["stuck"])
        # vLLM keeps its blocks until the request's one report: the tier's load ended at once, the pull
        # when its handshakes timed out (1 s, one retry)
        assert _settled(consumer) == dict.fromkeys(GAUGES, 0.0)
    usage = [m.value for m in engine_metrics(consumer) if m.name == "vllm:kv_cache_usage_perc"]
    assert usage == [0.0]
    decoded = generate(consumer, tokens)  # the prompt again, with nobody to pull from: exact all the same
    reference = generate(producer, tokens)
    assert reference.num_cached_tokens == 4 * BLOCK
    assert _tokens(decoded) == _tokens(reference)


def test_a_producer_killed_mid_transfer_costs_only_what_the_tier_lacks(
    engines: tuple[Any, Any, Path],
) -> None:
    # the last test of the shared engines: it kills the prefill engine
    producer, consumer = engines[:2]
    tokens, params = _owing_block_4(engines, 8501)
    reference = generate(producer, tokens)  # vLLM's own hit of blocks 0..3, block 4 computed
    assert reference.num_cached_tokens == 4 * BLOCK
    patience = 6.0  # the consumer's abort_timeout_s: the module's 30 s would only slow the test down
    assert consumer.collective_rpc(shorten_pd_patience, args=(patience,)) == [True]
    # the producer accepts the pull, writes half of block 4's ranges and is SIGKILLed
    (doomed,) = producer.collective_rpc(die_mid_write)
    before = (_pulled(consumer), external_hits(consumer), kvcore_metric(consumer, "loaded_blocks"))
    started = time.monotonic()
    decoded = generate(consumer, tokens, kv_transfer_params=params)
    # the pull failed when its abort_timeout_s passed (nothing tells the consumer of a death sooner)
    assert patience <= time.monotonic() - started < patience + 15.0
    assert _pulled(consumer) - before[0] == 0  # the half-written block is not taken
    assert _dead(doomed)  # it did die mid-transfer
    assert external_hits(consumer) - before[1] == len(tokens)  # counted at admission: tier + producer
    assert kvcore_metric(consumer, "loaded_blocks") - before[2] == 4  # the tier's part was used
    assert _tokens(decoded) == _tokens(reference)  # block 4 (written in part) recomputed: exact
    assert _settled(consumer) == dict.fromkeys(GAUGES, 0.0)  # nothing held for the dead producer


def test_a_tp1_producer_and_a_tp2_consumer_share_the_tier(vllm_env: Path, tmp_path: Path) -> None:
    # last: vLLM's metrics in this process are those of the engine started last, which the tests of the
    # shared engines read
    # four KV heads: each decode rank loads its two heads of each chunk from the tier (a value per head)
    # and pulls its two heads of the last block out of the producer's four
    heads = 4
    model = kv_heads_model(vllm_env, heads)
    store = tmp_path / "store"
    store.mkdir()
    disk = Disk(store, heads)
    tp = {"kv_producer": 1, "kv_consumer": TP}

    def start(role: str, engine_id: str, port: int) -> Any:
        return start_tp_engine(model, heads, pd_tiers_config(role, engine_id, port, store), tp=tp[role])

    with _pair(start) as (producer, consumer):
        tokens = prompt(8301, 3 * BLOCK + 1)
        _, params = _prefill(producer, tokens)
        assert params["remote_tp_size"] == 1
        disk.wait_for(1)  # chunk 0 (blocks 0-1); the producer owes blocks 2-3
        before = (consumer.collective_rpc(pulled_blocks), external_hits(consumer))
        decoded = generate(consumer, tokens, kv_transfer_params=params)
        pulled = [
            now - then for now, then in zip(consumer.collective_rpc(pulled_blocks), before[0], strict=True)
        ]
        assert pulled == [2] * TP  # every decode rank pulled blocks 2-3 only
        assert external_hits(consumer) - before[1] == len(tokens)
        again = generate(consumer, tokens)  # the blocks loaded and pulled are the consumer's own now
        assert again.num_cached_tokens == 3 * BLOCK
        # TP sizes round bf16 differently: only the first token compares like with like
        # (``test_vllm_pd_tp``); it is the producer's own prefix hit's
        local = generate(producer, tokens)
        assert local.num_cached_tokens == 3 * BLOCK
        assert tokens_of(decoded)[0] == tokens_of(local)[0]
