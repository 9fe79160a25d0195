"""Real vLLM engines of different tensor-parallel sizes sharing one remote tier (CPU build, a tiny model with
four KV heads): a TP-1 engine and a TP-2 engine run side by side, each with kvcore's connector over the
same tier (a disk tier's folder, a Mooncake store). A prompt computed by one is served to the other.

What must be equal is the bytes: every head of every layer of every block the reader loaded equals that
head of that layer in a block of the writer (read out of band on both engines: vLLM's KV tensors, by
vLLM's head ownership), and the reader finds every whole chunk. Tokens cannot be compared like with like
across TP sizes (bf16 rounds differently at each: the reader computes the prompt's last tokens and the
answer on KV another TP size rounded), so the first generated token is compared with the reader's own
prefix hit of the prompt (the KV it computed itself: under a cache salt, so that kvcore's keys differ).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attrs import frozen

from tests.integration.conftest import ENGINE_BLOCKS, prompt, stop_engine
from tests.integration.tp2 import (
    CHUNK,
    CHUNK_BLOCKS,
    LAYERS,
    PROMPT_CHUNKS,
    head_digests_probe,
    kv_heads_model,
    rank_heads,
    rank_load_probe,
    start_tp_engine,
    tier_config,
    tokens_of,
)

__all__ = ["KV_HEADS", "CrossRead", "both_engines", "check_read", "read_across", "salted_generate"]

KV_HEADS = 4
PROMPT_TOKENS = PROMPT_CHUNKS * CHUNK + 60  # whole chunks and a partial block (never stored)


@frozen
class CrossRead:
    """A prompt written at ``writer`` TP and read at ``reader`` TP: what the reader served and loaded."""

    writer: int
    reader: int
    cached: int  # the reader's cached tokens of the prompt (kvcore's hit)
    extra: Any  # the reader's kv_transfer_params: kvcore's extra cached tokens
    loaded: frozenset[tuple[int, int, str]]  # (layer, KV head, digest) of every head of every block loaded
    blocks: int  # blocks the reader loaded (on each rank)
    written: frozenset[tuple[int, int, str]]  # the same over every block of the writer after its run
    tokens: list[int]  # the reader's answer with kvcore's hit
    own: list[int]  # ... with its own prefix hit of the prompt


def salted_generate(llm: Any, tokens: list[int], salt: str | None = None, **extra: Any) -> Any:
    """One greedy request of 8 tokens, under a cache salt if given (kvcore's keys and vLLM's block hashes
    then differ from the unsalted prompt's); vLLM's ``RequestOutput``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8, extra_args=extra or None)
    request = TokensPrompt(prompt_token_ids=tokens)
    if salt is not None:
        request["cache_salt"] = salt
    (out,) = llm.generate([request], params, use_tqdm=False)
    return out


def _heads(llm: Any, tp: int, blocks: list[int]) -> frozenset[tuple[int, int, str]]:
    """``(layer, KV head, digest)`` of each head of ``blocks`` on each rank of the engine."""
    out: set[tuple[int, int, str]] = set()
    for rank, answer in enumerate(llm.collective_rpc(head_digests_probe, args=(blocks,))):
        got_rank, layers = answer
        assert got_rank == rank, f"collective_rpc answered rank {got_rank} at {rank}"
        heads = rank_heads(KV_HEADS, tp, rank)
        for layer, per_block in enumerate(layers):
            for digests in per_block:
                out.update((layer, heads[local], digest) for local, digest in enumerate(digests))
    return frozenset(out)


@contextlib.contextmanager
def both_engines(vllm_env: Path, backend: dict[str, Any]) -> Iterator[dict[int, Any]]:
    """A TP-1 and a TP-2 engine of the four-head model, each with kvcore over ``backend``."""
    model = kv_heads_model(vllm_env, KV_HEADS)
    engines: dict[int, Any] = {}
    try:
        for tp in (1, 2):
            engines[tp] = start_tp_engine(model, KV_HEADS, tier_config(backend), tp=tp)
        yield engines
    finally:
        for llm in engines.values():
            stop_engine(llm)


def read_across(engines: dict[int, Any], writer: int, reader: int, seed: int) -> CrossRead:
    """The writer computes a prompt (kvcore saves it); the reader is then served it: kvcore loads it from
    the tier. Then the reader computes it itself under a salt, and is served it again from its own
    prefix cache: the reference tokens."""
    tokens = prompt(seed, PROMPT_TOKENS)
    salted_generate(engines[writer], tokens)
    written = _heads(engines[writer], writer, list(range(ENGINE_BLOCKS)))
    served = salted_generate(engines[reader], tokens, kv_transfer_params={"num_extra_cached_tokens": True})
    loads = [answer[1] for answer in engines[reader].collective_rpc(rank_load_probe)]
    assert all(list(blocks) == list(loads[0]) for blocks in loads), f"the ranks loaded {loads}"
    loaded = _heads(engines[reader], reader, list(loads[0]))
    salted_generate(engines[reader], tokens, salt="computed here")
    own = salted_generate(engines[reader], tokens, salt="computed here")
    assert own.num_cached_tokens >= PROMPT_CHUNKS * CHUNK, "the reference is not vLLM's own prefix hit"
    return CrossRead(
        writer,
        reader,
        served.num_cached_tokens,
        served.kv_transfer_params,
        loaded,
        len(loads[0]),
        written,
        tokens_of(served),
        tokens_of(own),
    )


def check_read(read: CrossRead) -> None:
    """The reader found every whole chunk, loaded each head of each layer of them as the writer held
    it, and answered the first token its own prefix hit does."""
    whole = PROMPT_CHUNKS * CHUNK
    assert read.cached == whole, f"the reader at TP {read.reader} found {read.cached} of {whole} tokens"
    assert read.extra == {"num_extra_cached_tokens": whole}, read.extra
    assert read.blocks == PROMPT_CHUNKS * CHUNK_BLOCKS
    assert len(read.loaded) == read.blocks * KV_HEADS * LAYERS, "loaded blocks repeat a head's bytes"
    missing = read.loaded - read.written
    assert not missing, f"{len(missing)} heads loaded at TP {read.reader} the writer never held"
    assert read.tokens[:1] == read.own[:1], f"first token {read.tokens[:1]}, its own hit's {read.own[:1]}"
