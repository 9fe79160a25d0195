"""Disaggregated prefill/decode between two real vLLM engines (CPU build, tiny model, TP 1 each).

The prefill engine (``kv_producer``) computes a prompt with ``max_tokens=1``; its output's
``kv_transfer_params`` go to the decode engine (``kv_consumer``), which pulls the prompt's KV over
Mooncake's transfer engine and recomputes only the last prompt token (vLLM's P/D rule). The reference is
vLLM's own prefix hit with the same split of the work: the prompt is one token longer than whole blocks,
so a second run on the prefill engine hits every full block and computes that last token too. A decode
request whose producer cannot be reached is recomputed, within seconds, to a plain run's tokens.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvcore_cli.tiny_model import make_tiny_mla_model
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
from tests.integration.probes import external_hits
from tests.integration.test_vllm_mla import BLOCK as MLA_BLOCK
from tests.integration.test_vllm_mla import start_mla_engine
from tests.mooncake.conftest import free_port

__all__ = ["tiny_model", "vllm_env"]  # fixtures, re-exported for this module

pytestmark = VLLM_MARKS

HANDSHAKE_S = 1.0


def pd_transfer_config(role: str, engine_id: str, port: int) -> dict[str, Any]:
    pd = {"port": port, "handshake_timeout_s": HANDSHAKE_S, "handshake_retries": 1, "abort_timeout_s": 30.0}
    return {
        "kv_connector": "KVCorePDConnector",
        "kv_connector_module_path": "kvcore_vllm.pd_connector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pd": pd},
    }


def _tokens(out: Any) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_decode_engine_continues_the_prefill_engines_prompt(tiny_model: Path) -> None:
    producer = start_engine(tiny_model, pd_transfer_config("kv_producer", "prefill-0", free_port()))
    try:
        consumer = start_engine(tiny_model, pd_transfer_config("kv_consumer", "decode-0", 0))
        try:
            tokens = prompt(7001, 3 * BLOCK + 1)
            prefill = generate(producer, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            params = prefill.kv_transfer_params
            assert params is not None
            assert params["do_remote_prefill"] is True
            assert params["remote_engine_id"] == "prefill-0"
            assert params["remote_num_tokens"] == len(tokens)
            assert len(params["remote_block_ids"][0]) == 4  # three full blocks and the last token's

            before = external_hits(consumer)  # the metrics registry is per process: count deltas
            decoded = generate(consumer, tokens, kv_transfer_params=params)
            local = generate(producer, tokens)  # vLLM's own prefix hit: every full block, 1 token computed
            assert local.num_cached_tokens == 3 * BLOCK
            # vLLM's P/D accounting: the decode engine reports the prefill engine's own cache hits as its
            # cached tokens, and the transferred prompt as external (connector) hits.
            assert decoded.num_cached_tokens == params["remote_prefill_cached_tokens"] == 0
            assert external_hits(consumer) - before == len(tokens)
            assert _tokens(decoded) == _tokens(local)

            # The decode engine now holds the prompt's 3 full blocks itself: a longer prompt sharing them
            # pulls only what its own prefix hit lacks.
            longer = tokens[: 3 * BLOCK] + prompt(7003, BLOCK + 1)
            prefill2 = generate(producer, longer, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            params2 = prefill2.kv_transfer_params
            assert params2 is not None
            before = external_hits(consumer)
            decoded2 = generate(consumer, longer, kv_transfer_params=params2)
            local2 = generate(producer, longer)
            assert local2.num_cached_tokens == 4 * BLOCK
            assert external_hits(consumer) - before == len(longer) - 3 * BLOCK
            assert _tokens(decoded2) == _tokens(local2)

            # A producer nobody listens for: the decode engine computes the prompt itself, no hang.
            other = prompt(7002, 2 * BLOCK + 1)
            plain = generate(producer, other)  # a fresh prompt there: a full prefill, as the recompute
            gone = {
                **params,
                "transfer_id": "never-offered",
                "remote_bootstrap_addr": f"tcp://127.0.0.1:{free_port()}",
                "remote_block_ids": [[0, 1, 2]],
                "remote_num_tokens": len(other),
            }
            before = external_hits(consumer)
            started = time.monotonic()
            recomputed = generate(consumer, other, kv_transfer_params=gone)
            assert time.monotonic() - started < 20 * HANDSHAKE_S
            assert _tokens(recomputed) == _tokens(plain)
            assert recomputed.num_cached_tokens == 0
            # vLLM counts external hits at admission, before the load failed.
            assert external_hits(consumer) - before == len(other)
        finally:
            stop_engine(consumer)
    finally:
        stop_engine(producer)


def test_an_mla_decode_engine_continues_the_prefill_engines_prompt(vllm_env: Path) -> None:
    # MLA engines keep one latent per token, the same bytes on every rank: the decode engine pulls the
    # prompt's latents and computes its last token, with the tokens of the prefill engine's own full
    # recompute (vLLM keeps no prefix cache for MLA on the CPU: there is no prefix hit to compare with)
    model = make_tiny_mla_model(vllm_env / "tiny-mla-pd")
    producer = start_mla_engine(model, pd_transfer_config("kv_producer", "prefill-mla", free_port()))
    try:
        consumer = start_mla_engine(model, pd_transfer_config("kv_consumer", "decode-mla", 0))
        try:
            tokens = prompt(7101, 20 * MLA_BLOCK + 1)
            prefill = generate(producer, tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            params = prefill.kv_transfer_params
            assert params is not None
            assert len(params["remote_block_ids"][0]) == 21
            before = external_hits(consumer)
            decoded = generate(consumer, tokens, kv_transfer_params=params)
            assert external_hits(consumer) - before == len(tokens)
            assert _tokens(decoded) == _tokens(generate(producer, tokens))
        finally:
            stop_engine(consumer)
    finally:
        stop_engine(producer)
