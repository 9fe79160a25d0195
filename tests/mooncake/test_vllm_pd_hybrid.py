"""P/D with a hybrid model (Gemma-3 style: sliding-window and full attention layers, made locally) between
two real vLLM engines (CPU build, TP 1), vLLM's hybrid KV-cache manager on in both.

vLLM keeps the model as two KV-cache groups, each with its own block table, whose layers share the KV
tensors. The prefill engine's params name its blocks in both groups; the decode engine pulls, in each
group, the blocks it holds past its own prefix hit for every prompt token but the last (which it computes
with its whole window): the full attention group every one, the sliding-window group only those of the
last window (vLLM gives it the null block before the window); the prefill engine computed every prompt
token but the last too, so it kept the blocks of that last token's window. Tokens equal vLLM's own
prefix hit of the same length. Where the producer is gone, the request is recomputed whole (vLLM takes a
failed load of several groups by request), within seconds. A TP-1 prefill engine and a TP-2 decode engine:
each decode rank pulls, in both groups, its one KV head of the producer's two, byte for byte, and the tokens
equal the decode engine's own prefix hit of the blocks it pulled.

A hybrid SSM model (Qwen3-Next style: Gated DeltaNet and full attention layers) moves its attention
blocks and, of each GDN group, the one block holding the state after the prompt but its last token, which
the prefill engine computed that far (through ``KVCoreConnector``'s ``pd`` section, each engine with a
CPU pool of its own); from a TP-1 prefill engine to a TP-2 decode engine, each decode rank's states are
its slices of the prefill engine's, byte for byte, as vLLM's own views of them show.

The hybrid model through ``KVCoreConnector`` with a ``pd`` section beside a shared disk tier: the decode
engine loads, in both groups, what the tier holds (the prefill engine saved it as it computed) and pulls
only the blocks past it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcore_cli.tiny_model import HYBRID_WINDOW, make_tiny_hybrid_model, make_tiny_ssm_model
from tests.integration.conftest import (
    BLOCK,
    VLLM_MARKS,
    generate,
    prompt,
    start_engine,
    stop_engine,
    vllm_env,
)
from tests.integration.probes import external_hits, pulled_blocks
from tests.integration.test_vllm_hybrid import (
    FULL_GROUP,
    SWA_GROUP,
    start_hybrid_engine,
)
from tests.integration.test_vllm_ssm import BLOCK as SSM_BLOCK
from tests.integration.test_vllm_ssm import STATE_GROUPS as SSM_STATE_GROUPS
from tests.integration.tp2 import (
    TP,
    as_tensor,
    engine_env,
    head_digests_probe,
    receive_probe,
    record_receives_probe,
    states_probe,
)
from tests.mooncake.conftest import free_port, patient_transfers
from tests.mooncake.test_vllm_pd import HANDSHAKE_S, pd_transfer_config
from tests.mooncake.test_vllm_pd_tiers import Disk, _from_producers, _pair, pd_tiers_config

__all__ = ["vllm_env"]  # a fixture, re-exported for this module

pytestmark = VLLM_MARKS


def _generous(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` whose side channel waits long for its peers: the ranks of a TP-2 engine, and a prefill
    engine's notices to them, share two cores with the test run's other lane."""
    config["kv_connector_extra_config"]["pd"].update(handshake_timeout_s=20.0, handshake_retries=3)
    return config


@contextlib.contextmanager
def _started(start: Callable[[], Any]) -> Iterator[Any]:
    """An engine of ``start`` (its transfers patient), stopped after."""
    with patient_transfers():
        engine = start()
    try:
        yield engine
    finally:
        stop_engine(engine)


@pytest.fixture(scope="module")
def model(vllm_env: Path) -> Path:
    return make_tiny_hybrid_model(vllm_env / "tiny-hybrid-pd")


@pytest.fixture(scope="module")
def engines(model: Path) -> Iterator[tuple[Any, Any]]:
    """A prefill and a decode engine of the P/D connector."""

    def start(role: str, engine_id: str, port: int) -> Any:
        config = pd_transfer_config(role, engine_id, port)
        # the prefill engine serves a TP-2 decode engine too; the decode engine's handshake stays short
        # (the producer-gone test times it)
        return start_hybrid_engine(model, _generous(config) if role == "kv_producer" else config)

    with _pair(start) as pair:
        yield pair


def _tokens(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def _pulled(llm: Any) -> int:
    return sum(llm.collective_rpc(pulled_blocks))


def _window_blocks(first: int, num_tokens: int) -> int:
    """Blocks ``first..`` of a prompt of ``num_tokens`` the sliding-window group holds when a request's
    first ``num_tokens`` tokens are computed: those not wholly before its window (vLLM's rule)."""
    skipped = max(num_tokens - HYBRID_WINDOW + 1, 0) // BLOCK
    return -(-num_tokens // BLOCK) - max(first, skipped)


def _own_hit(producer: Any, tokens: list[int], hit: int) -> Any:
    """vLLM's own prefix hit of ``hit`` tokens on the prefill engine (8 tokens generated). A prefill for
    the decode engine left the prompt's last token: its computed tokens end at a block's end, and vLLM
    0.32 then serves this model a block less to the next request (plain requests too: one of 640 tokens,
    then one of 641 sharing them, hits 512); the run after that one hits every block."""
    for _ in range(2):
        out = generate(producer, tokens, max_tokens=8)
        if out.num_cached_tokens == hit:
            return out
    raise AssertionError(f"vLLM's own prefix hit: {out.num_cached_tokens} tokens, {hit} expected")


def _pd(producer: Any, consumer: Any, tokens: list[int], max_tokens: int = 8) -> tuple[Any, dict[str, Any]]:
    prefill = generate(producer, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = prefill.kv_transfer_params
    assert params is not None
    return generate(consumer, tokens, max_tokens=max_tokens, kv_transfer_params=params), params


def test_both_engines_keep_vllms_hybrid_manager(engines: tuple[Any, Any]) -> None:
    for llm in engines:
        config = llm.llm_engine.vllm_config
        assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert config.kv_transfer_config.kv_connector == "KVCorePDConnector"


def test_each_group_pulls_its_blocks_and_the_tokens_are_vllms_own_prefix_hit(
    engines: tuple[Any, Any],
) -> None:
    from kvcore_vllm.scheduler_side import NULL_BLOCK  # with vLLM, which the engines imported

    producer, consumer = engines
    tokens = prompt(7201, 5 * BLOCK + 1)
    pulled, hits = _pulled(consumer), external_hits(consumer)
    decoded, params = _pd(producer, consumer, tokens)
    groups = params["remote_block_ids"]
    assert [len(group) for group in groups] == [5, 5]  # the prefill engine computed all but the last token
    assert NULL_BLOCK not in groups[FULL_GROUP]
    # the producer gave back the sliding-window blocks before its window, as the decode engine holds none
    assert groups[SWA_GROUP].count(NULL_BLOCK) == 5 - _window_blocks(0, len(tokens) - 1)
    assert external_hits(consumer) - hits == len(tokens) - 1
    # every block of the full attention group; of the sliding-window group, those of the last window
    assert _pulled(consumer) - pulled == 5 + _window_blocks(0, len(tokens) - 1)
    assert _window_blocks(0, len(tokens) - 1) < 5
    local = _own_hit(producer, tokens, 5 * BLOCK)  # vLLM's own prefix hit: 5 blocks, 1 token computed
    assert _tokens(decoded) == _tokens(local)

    # the decode engine now holds the prompt's blocks: a longer prompt sharing them pulls, in each group,
    # only the blocks past its own prefix hit
    longer = tokens[: 5 * BLOCK] + prompt(7202, 2 * BLOCK + 1)
    pulled, hits = _pulled(consumer), external_hits(consumer)
    decoded, _ = _pd(producer, consumer, longer)
    assert external_hits(consumer) - hits == len(longer) - 1 - 5 * BLOCK
    assert _pulled(consumer) - pulled == 2 + _window_blocks(5, len(longer) - 1)
    local = _own_hit(producer, longer, 7 * BLOCK)
    assert _tokens(decoded) == _tokens(local)


def test_the_window_of_the_last_token_is_whole_where_its_oldest_key_ends_a_block(
    engines: tuple[Any, Any],
) -> None:
    from kvcore_vllm.scheduler_side import NULL_BLOCK

    producer, consumer = engines
    # the oldest key of the last token's window is block 3's last token: a prefill engine that computed
    # the last token too would have given block 3 back
    tokens = prompt(7204, HYBRID_WINDOW - 1 + 4 * BLOCK)
    pulled = _pulled(consumer)
    decoded, params = _pd(producer, consumer, tokens)
    assert params["remote_block_ids"][SWA_GROUP][3] != NULL_BLOCK
    assert _pulled(consumer) - pulled == 6 + _window_blocks(0, len(tokens) - 1)
    local = _own_hit(producer, tokens, 5 * BLOCK)
    assert _tokens(decoded) == _tokens(local)


def test_a_producer_gone_costs_a_recompute_of_the_request(engines: tuple[Any, Any]) -> None:
    producer, consumer = engines
    tokens = prompt(7203, 3 * BLOCK + 1)
    plain = generate(producer, tokens, max_tokens=8)  # a fresh prompt there: a full prefill
    gone = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "never-offered",
        "remote_engine_id": "prefill-gone",
        "remote_bootstrap_addr": f"tcp://127.0.0.1:{free_port()}",
        "remote_tp_size": 1,
        "remote_block_ids": [[1, 2, 3, 4], [5, 6, 7, 8]],
        "remote_num_tokens": len(tokens),
    }
    pulled = _pulled(consumer)
    started = time.monotonic()
    recomputed = generate(consumer, tokens, max_tokens=8, kv_transfer_params=gone)
    assert time.monotonic() - started < 20 * HANDSHAKE_S
    assert _pulled(consumer) == pulled
    assert recomputed.num_cached_tokens == 0
    assert _tokens(recomputed) == _tokens(plain)


def test_beside_a_tier_each_group_loads_the_tiers_part_and_pulls_the_rest(
    model: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    disk = Disk(store, heads=2 * 2)  # a file per KV head of each chunk, in each of the two groups

    def start(role: str, engine_id: str, port: int) -> Any:
        return start_hybrid_engine(model, pd_tiers_config(role, engine_id, port, store))

    with _pair(start) as (producer, consumer):
        for llm in (producer, consumer):
            assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        tokens = prompt(7301, 5 * BLOCK + 1)
        prefill = generate(producer, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = prefill.kv_transfer_params
        assert params is not None
        assert params["remote_tier_tokens"] == 0
        disk.wait_for(2)  # chunks of two blocks: blocks 0..3 saved in both groups; block 4 ends no chunk
        before = (_pulled(consumer), external_hits(consumer), _from_producers(consumer))
        decoded = generate(consumer, tokens, max_tokens=8, kv_transfer_params=params)
        # blocks 0..3 from the tier (the sliding-window group: those of the hit's window); block 4 pulled
        # in each group (the last token is computed here)
        assert _pulled(consumer) - before[0] == 1 + _window_blocks(4, len(tokens) - 1)
        assert external_hits(consumer) - before[1] == len(tokens) - 1
        assert _from_producers(consumer) - before[2] == len(tokens) - 1 - 4 * BLOCK
        local = _own_hit(producer, tokens, 5 * BLOCK)  # vLLM's own prefix hit: 5 blocks, 1 computed
        assert _tokens(decoded) == _tokens(local)

        # a producer gone: vLLM recomputes the request whole (a failed load of several groups)
        other = prompt(7302, 4 * BLOCK + 100)
        plain = generate(producer, other, max_tokens=8)  # a full prefill, which the tier keeps
        disk.wait_for(4)
        gone = {
            **params,
            "remote_bootstrap_addr": f"tcp://127.0.0.1:{free_port()}",
            "remote_num_tokens": len(other),
        }
        pulled = _pulled(consumer)
        started = time.monotonic()
        recomputed = generate(consumer, other, max_tokens=8, kv_transfer_params=gone)
        assert time.monotonic() - started < 20.0
        assert _pulled(consumer) == pulled
        assert _tokens(recomputed) == _tokens(plain)


def test_a_tp1_producer_and_a_tp2_consumer_move_each_groups_heads(
    model: Path, engines: tuple[Any, Any]
) -> None:
    from kvcore_vllm.scheduler_side import NULL_BLOCK  # with vLLM, which the engines imported

    producer = engines[0]  # the module's TP-1 prefill engine
    config = _generous(pd_transfer_config("kv_consumer", "decode-1", 0))
    with _started(lambda: start_hybrid_engine(model, config, tp=TP)) as consumer:
        assert consumer.collective_rpc(record_receives_probe) == list(range(TP))
        tokens = prompt(7501, 5 * BLOCK + 1)
        prefill = generate(producer, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = prefill.kv_transfer_params
        assert params is not None
        held = [block for group in params["remote_block_ids"] for block in group if block != NULL_BLOCK]
        # the producer holds the blocks until the consumer pulled them: read its heads now
        ((_, held_heads),) = producer.collective_rpc(head_digests_probe, args=(held,))
        decoded = generate(consumer, tokens, max_tokens=8, kv_transfer_params=params)
        records = consumer.collective_rpc(receive_probe, args=(params["transfer_id"],))
        assert [rank for rank, _ in records] == list(range(TP))
        pairs = set()
        for rank, record in records:
            assert record is not None, f"decode rank {rank} was given no receive"
            _, src, dst, ok = record
            assert ok is True, f"decode rank {rank}: the pull did not succeed"
            pairs.add((tuple(src), tuple(dst)))
        ((src, dst),) = pairs  # every rank pulls the same blocks into the same blocks
        # the full attention group's blocks, and the sliding-window group's of the last window
        assert len(src) == 5 + _window_blocks(0, len(tokens) - 1)
        got = consumer.collective_rpc(head_digests_probe, args=(list(dst),))
        assert [rank for rank, _ in got] == list(range(TP))
        for rank, layers in got:
            # its one KV head of every layer of every pulled block is the producer's head ``rank`` there
            for layer, blocks in enumerate(layers):
                for j, heads in enumerate(blocks):
                    assert heads == [held_heads[layer][held.index(src[j])][rank]], (rank, layer, src[j])
        # bf16 rounds differently at another TP size (the producer's own hit gives other tokens here), so
        # the tokens are compared with the decode engine's own prefix hit of the blocks it pulled: the
        # pulled blocks serve as its own cache does (their bytes are checked above)
        local = _own_hit(consumer, tokens, 5 * BLOCK)
        assert _tokens(decoded) == _tokens(local)


def _ssm_engine(model: Path, role: str, engine_id: str, port: int, tp: int = 1) -> Any:
    """An engine of the hybrid SSM model through ``KVCoreConnector`` with a ``pd`` section beside a CPU
    pool of its own: the decode engine's pool never saw the prompt, so every block comes through P/D."""
    config = _generous(pd_tiers_config(role, engine_id, port, Path()))
    extra = config["kv_connector_extra_config"]
    del extra["chunk_tokens"]  # a hybrid SSM model's chunks are vLLM's block
    del extra["tiers"]
    extra["backend"] = {"kind": "cpu", "size": "64MiB"}
    with engine_env(tp):
        return start_engine(
            model,
            config,
            kv_cache_memory_bytes=64 << 20,
            enable_prefix_caching=True,
            max_num_batched_tokens=1024,
            tensor_parallel_size=tp,
        )


@pytest.fixture(scope="module")
def ssm_producer(vllm_env: Path) -> Iterator[tuple[Any, Path]]:
    """A TP-1 prefill engine of the hybrid SSM model and the model, shared by the decode engines of the
    tests (each its own prompts)."""
    model = make_tiny_ssm_model(vllm_env / "tiny-ssm-pd")
    with _started(lambda: _ssm_engine(model, "kv_producer", "prefill-0", free_port())) as producer:
        yield producer, model


def _ssm_consumer(ssm_producer: tuple[Any, Path], engine_id: str, tp: int = 1) -> Any:
    """A decode engine of the hybrid SSM model at TP ``tp``, stopped after (a context manager)."""
    return _started(lambda: _ssm_engine(ssm_producer[1], "kv_consumer", engine_id, 0, tp=tp))


def test_a_hybrid_ssm_models_states_move_with_its_pages(ssm_producer: tuple[Any, Path]) -> None:
    from kvcore_vllm.scheduler_side import NULL_BLOCK  # with vLLM, which the engines imported

    producer = ssm_producer[0]
    with _ssm_consumer(ssm_producer, "decode-0") as consumer:
        tokens = prompt(7401, 3 * SSM_BLOCK + 1)
        pulled = _pulled(consumer)
        decoded, params = _pd(producer, consumer, tokens)
        *states, full = params["remote_block_ids"]
        assert len(states) == len(SSM_STATE_GROUPS)
        # each GDN group holds the state after the prompt but its last token, in the block ending there
        assert all(group[:2] == [NULL_BLOCK, NULL_BLOCK] and group[2] != NULL_BLOCK for group in states)
        assert NULL_BLOCK not in full
        assert _pulled(consumer) - pulled == 3 + len(states)  # the attention blocks and one state a group
        # a wrong state changes the greedy tokens (the model's states decay slowly)
        local = _own_hit(producer, tokens, 3 * SSM_BLOCK)
        assert _tokens(decoded) == _tokens(local)


def test_a_tp1_producer_and_a_tp2_consumer_split_each_gdn_state(ssm_producer: tuple[Any, Path]) -> None:
    import torch

    from kvcore_vllm.scheduler_side import NULL_BLOCK  # with vLLM, which the engines imported

    producer = ssm_producer[0]
    with _ssm_consumer(ssm_producer, "decode-1", tp=TP) as consumer:
        assert consumer.collective_rpc(record_receives_probe) == list(range(TP))
        tokens = prompt(7403, 3 * SSM_BLOCK + 1)
        prefill = generate(producer, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = prefill.kv_transfer_params
        assert params is not None
        *states, full = params["remote_block_ids"]
        held = [group[2] for group in states]  # each GDN group's state block
        # the producer holds its blocks until the consumer pulled them: read its states now
        ((_, produced),) = producer.collective_rpc(states_probe, args=(held,))
        decoded = generate(consumer, tokens, max_tokens=8, kv_transfer_params=params)
        records = consumer.collective_rpc(receive_probe, args=(params["transfer_id"],))
        moved = set()
        for rank, record in records:
            assert record is not None, f"decode rank {rank} was given no receive"
            assert record[3] is True, f"decode rank {rank}: the pull did not succeed"
            moved.add(tuple(zip(record[1], record[2], strict=True)))
        ((pairs,),) = [moved]  # every rank pulls the same blocks into the same blocks
        into = dict(pairs)
        assert set(into) == {*held, *(b for b in full if b != NULL_BLOCK)}
        got = consumer.collective_rpc(states_probe, args=([into[block] for block in held],))
        assert [rank for rank, _ in got] == list(range(TP))
        for rank, layers in got:
            assert len(layers) == len(produced) == len(SSM_STATE_GROUPS)
            for layer, blocks in enumerate(layers):
                for i, raw in enumerate(blocks):
                    conv, recurrent = (as_tensor(state) for state in raw)
                    whole_conv, whole_recurrent = (as_tensor(state) for state in produced[layer][i])
                    # vLLM's views: the convolution state (SD: steps x channels, DS: channels x steps; a
                    # rank's channels are its Q, K and V slices) and the recurrent state of its value heads
                    axis = 1 if conv.shape[0] == whole_conv.shape[0] else 0
                    key = (whole_conv.shape[axis] - whole_recurrent.shape[0] * whole_recurrent.shape[1]) // 2
                    value = whole_conv.shape[axis] - 2 * key
                    starts = (0, key, 2 * key)
                    sizes = (key // TP, key // TP, value // TP)
                    want = torch.cat(
                        [
                            whole_conv.narrow(axis, start + rank * size, size)
                            for start, size in zip(starts, sizes, strict=True)
                        ],
                        dim=axis,
                    )
                    heads = whole_recurrent.shape[0] // TP
                    assert torch.equal(conv, want), (rank, layer, held[i])
                    assert torch.equal(recurrent, whole_recurrent[rank * heads : (rank + 1) * heads])
        # bf16 rounds differently at another TP size: the tokens are compared with the decode engine's own
        # prefix hit of the blocks it pulled (the states' bytes are checked above)
        local = _own_hit(consumer, tokens, 3 * SSM_BLOCK)
        assert _tokens(decoded) == _tokens(local)
