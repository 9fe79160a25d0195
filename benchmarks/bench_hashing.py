"""Chunk hashing throughput against vLLM's default per-block request hasher, measured in the same run.

The baseline reproduces vLLM's default (``sha256``) block hash: SHA-256 over
``pickle.dumps((parent, tuple(block_tokens), None))`` per block, chained. kvcore is measured at the same
granularities and at its default chunk size; ``regroup_block_hashes`` (what the vLLM adapter does instead
of hashing) and key rendering are timed per request.

    python -m benchmarks.bench_hashing [--quick] [--tokens N]
"""

from __future__ import annotations

import argparse
import functools
import hashlib

# The baseline reproduces vLLM's pickle-based hash; kvcore itself never pickles.
import pickle  # noqa: TID251
import random
import statistics
import time
from collections.abc import Callable, Sequence

import attrs

from kvcore.keying.hashing import ChunkHasher, HashAlgorithm, regroup_block_hashes
from kvcore.keying.keys import Keyspace, Namespace, Shard

VLLM_DEFAULT_BLOCK = 16
KVCORE_DEFAULT_CHUNK = 256
_NONE_HASH = hashlib.sha256(b"").digest()  # vLLM's sha256 NONE_HASH is a fixed 32-byte value too


def vllm_block_hashes(tokens: list[int], block: int) -> list[bytes]:
    """vLLM's default request block hasher: one pickled SHA-256 per full block."""
    hashes = []
    parent = _NONE_HASH
    for start in range(0, len(tokens) - block + 1, block):
        block_tokens = tokens[start : start + block]
        payload = pickle.dumps((parent, tuple(block_tokens), None), protocol=pickle.HIGHEST_PROTOCOL)
        parent = hashlib.sha256(payload).digest()
        hashes.append(parent)
    return hashes


def interleaved_medians(cases: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds per case, timing the cases round-robin so that load drift hits all alike."""
    samples: list[list[float]] = [[] for _ in cases]
    for case in cases:
        case()  # warm-up
    for _ in range(repeats):
        for case, times in zip(cases, samples, strict=True):
            start = time.perf_counter()
            case()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in samples]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=32768, help="prompt length (default 32768)")
    parser.add_argument("--repeats", type=int, default=100, help="timed runs per row (median reported)")
    parser.add_argument("--quick", action="store_true", help="a few seconds: fewer repeats")
    args = parser.parse_args(argv)
    repeats = 10 if args.quick else args.repeats
    rng = random.Random(0)
    tokens = [rng.randrange(152_000) for _ in range(args.tokens)]
    n = len(tokens)

    granularities = (VLLM_DEFAULT_BLOCK, 128, KVCORE_DEFAULT_CHUNK)
    rows: list[tuple[str, int, Callable[[], object]]] = [
        ("vLLM sha256(pickle) per block", g, functools.partial(vllm_block_hashes, tokens, g))
        for g in granularities
    ]
    for algorithm in HashAlgorithm:
        for g in granularities:
            hasher = ChunkHasher(algorithm, b"bench", g)
            rows.append((f"kvcore {algorithm.value}", g, functools.partial(hasher.hash_tokens, tokens)))
    medians = interleaved_medians([case for _, _, case in rows], repeats)
    baseline = dict(zip(granularities, medians, strict=False))  # the vLLM rows come first
    default = baseline[VLLM_DEFAULT_BLOCK]
    print(f"chunk hashing, {n} tokens, median of {repeats} interleaved runs")
    print(f"{'hasher':32} {'tokens/hash':>11} {'Mtok/s':>8} {'x vLLM@16':>10} {'x vLLM same':>12}")
    for (name, granularity, _), seconds in zip(rows, medians, strict=True):
        print(
            f"{name:32} {granularity:>11} {n / seconds / 1e6:>8.1f} {default / seconds:>9.2f}x"
            f" {baseline[granularity] / seconds:>11.2f}x"
        )

    block_hashes = vllm_block_hashes(tokens, VLLM_DEFAULT_BLOCK)
    chunk_hashes = regroup_block_hashes(block_hashes, VLLM_DEFAULT_BLOCK, KVCORE_DEFAULT_CHUNK)
    namespace = Namespace(
        "bench-model", "0", "bfloat16", 32, 8, 128, "flash_attn", 16, 256, HashAlgorithm.SHA256, "00"
    )
    shard = Shard(0, 32, 0, 8)
    plain = Keyspace(namespace, shard)
    keyed = Keyspace(attrs.evolve(namespace, secret=b"bench-secret"), shard)
    steps: list[tuple[str, Callable[[], object]]] = [
        (
            f"regroup_block_hashes ({VLLM_DEFAULT_BLOCK} -> {KVCORE_DEFAULT_CHUNK})",
            functools.partial(regroup_block_hashes, block_hashes, VLLM_DEFAULT_BLOCK, KVCORE_DEFAULT_CHUNK),
        ),
        ("Keyspace.keys, no secret", functools.partial(plain.keys, chunk_hashes)),
        ("Keyspace.keys, HMAC-SHA256", functools.partial(keyed.keys, chunk_hashes)),
    ]
    print()
    print(f"per request of {n} tokens ({len(chunk_hashes)} chunks of {KVCORE_DEFAULT_CHUNK})")
    print(f"{'step':40} {'us':>9} {'share of vLLM@16 hashing':>25}")
    for (name, _), seconds in zip(
        steps, interleaved_medians([c for _, c in steps], repeats * 10), strict=True
    ):
        print(f"{name:40} {seconds * 1e6:>9.1f} {seconds / default:>25.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
