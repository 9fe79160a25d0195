"""LMCache server throughput and lookup latency through kvcore against LMCache's own request client.

One ``lmcache server`` (started here, loopback, shared memory) serves both sides. For each value size,
``--chunks`` chunks are stored, then loaded, then looked up:

- kvcore: ``LMCacheManagedTier`` (store: submit, wait; load: lookup, poll, retrieve, wait, end the
  session) and ``LMCacheChunkIndex`` (lookup: submit, poll until answered). The chunks go as one chain
  (one token sequence, each kvcore key rendered as one chunk of token ids), and each slot carries a
  32-byte header that a load checks.
- LMCache: its raw ``RequestClient`` used the way LMCache's engine-driven transfer uses it: the chunks
  as one token sequence, so one ``prepare_store``/``commit_store`` pair for all of them (the server
  hands out one shared-memory slot per chunk), one ``lookup`` + ``query_prefetch_status``, one
  ``prepare_retrieve``/``commit_retrieve``; the same memory copies, no header.

Both sides copy between the same kind of host buffer and the same shared-memory pool, alternate within
each repeat, and use fresh keys every time (the server ignores re-stores). Throughputs and latencies are
medians; a ratio is the median of per-repeat ratios (> 1: kvcore faster).

``--blocks``: kvcore moves the values between a CPU engine's KV blocks (16 blocks of one layer per
chunk) and the slots with its block mover (``submit_store_blocks`` /
``submit_retrieve_blocks``, the default deployment: no host pool), against the same raw client copying
from and into a host buffer.

``--calls``: instead of timing, counts the server requests of one load of ``--chunks`` chunks as each
connector makes it in vLLM with no host pool: kvcore's scheduler lookup (``LMCacheChunkIndex``) and
its worker's retrieve straight into engine blocks (which locks what it reads with a lookup of its own)
and session end; LMCache's connector's lookup, whose locks its worker's retrieve consumes, and session
end. Lookups per load and requests per chunk, side by side.

    python -m benchmarks.bench_lmcache [--quick] [--blocks] [--calls] [--chunks 32] [--url tcp://127.0.0.1:5555]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

from kvcore.testing.counting import CallCounter
from kvcore.testing.support import start_owned

with warnings.catch_warnings():  # lmcache's OpenTelemetry handler warns of its own deprecation
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.transport.base import RequestClient
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    from kvcore.ids import ChunkKey, RequestId
    from kvcore.model.layout import KVLayout, LayoutKind
    from kvcore.ports import BlockItem, StoreItem
    from kvcore_cpu.engine_kv import EngineKV
    from kvcore_cpu.tier import MappedMovers
    from kvcore_lmcache import LMCacheChunkIndex, LMCacheManagedTier
    from kvcore_lmcache.config import LMCacheMPConfig
    from kvcore_lmcache.link import register_slots

KiB = 1 << 10
MiB = 1 << 20
SIZES = (64 * KiB, 256 * KiB, 1 * MiB)
CHUNK_TOKENS = 256
BLOCKS_PER_CHUNK = 16  # with --blocks: engine blocks per chunk (vLLM's 16-token blocks, 256-token chunks)
TIMEOUT_S = 10.0
POLL_S = 20e-6
READY_S = 120.0
_ids = itertools.count()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def lmcache_server(l1_gb: float) -> Iterator[tuple[str, float]]:
    """A fresh ``lmcache server`` on loopback: its URL and how long it took to answer."""
    cli = shutil.which("lmcache", path=str(Path(sys.executable).parent))
    if cli is None:
        raise SystemExit("the `lmcache` command is not installed next to this interpreter")
    port = _free_port()
    shm = f"kvcore_bench_{uuid.uuid4().hex[:8]}"
    argv = [
        cli, "server", "--host", "127.0.0.1", "--port", str(port), "--chunk-size", str(CHUNK_TOKENS),
        "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
        "--shm-name", shm, "--disable-metrics", "--http-host", "127.0.0.1", "--http-port", str(_free_port()),
    ]  # fmt: skip
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1")
    url = f"tcp://127.0.0.1:{port}"
    started = time.monotonic()
    process = start_owned(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0
    )
    try:
        client = RequestClientFactory.create(url)
        try:
            while client_size(client) != CHUNK_TOKENS:
                if process.poll() is not None or time.monotonic() - started > READY_S:
                    raise SystemExit(f"lmcache server did not start (exit code {process.poll()})")
        finally:
            client.close()
        yield url, time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        Path("/dev/shm", f"lmcache_l1_pool_{shm}").unlink(missing_ok=True)


def client_size(client: RequestClient) -> int | None:
    try:
        return client.get_chunk_size().result(timeout=0.5)
    except TimeoutError:
        return None


class RawSide:
    """LMCache's request client, registered for ``value_bytes`` slots, its chunks as one sequence."""

    def __init__(self, url: str, value_bytes: int, host: bytearray) -> None:
        self.value_bytes = value_bytes
        self.host = memoryview(host)
        self.client = RequestClientFactory.create(url)
        self.instance_id = uuid.uuid4().int & ((1 << 62) - 1)
        self.model = f"raw-bench-{value_bytes}"
        self.segment = register_slots(
            url, self.client, self.instance_id, self.model, CHUNK_TOKENS, value_bytes, TIMEOUT_S
        )
        self.shm = self.segment.view

    def key(self, tokens: tuple[int, ...], worker: int | None, session: str) -> IPCCacheServerKey:
        return IPCCacheServerKey(
            model_name=self.model,
            world_size=1,
            worker_id=worker,
            token_ids=tokens,
            start=0,
            end=len(tokens),
            request_id=session,
            num_kv_readers=1,
        )

    def ops(self, tokens: tuple[int, ...]) -> dict[str, Callable[[], int]]:
        """The timed operations on one round's chunks; each returns how many chunks it handled."""
        return {
            "store": lambda: self.store(tokens),
            "load": lambda: self.load(tokens),
            "lookup": lambda: self.probe(tokens),
        }

    def store(self, tokens: tuple[int, ...]) -> int:
        key = self.key(tokens, 0, f"store-{next(_ids)}")
        reply = self.client.prepare_store(key, self.instance_id).result(timeout=TIMEOUT_S)
        slots = reply.context["slots"]
        for i, slot in enumerate(slots):
            offset = int(slot["offset"])
            self.shm[offset : offset + self.value_bytes] = self.host[
                i * self.value_bytes : (i + 1) * self.value_bytes
            ]
        if not self.client.commit_store(key, self.instance_id, b"").result(timeout=TIMEOUT_S):
            raise RuntimeError("commit_store failed")
        self.client.end_session(key.request_id)
        return len(slots)

    def lookup(self, tokens: tuple[int, ...], session: str) -> int:
        self.client.lookup(self.key(tokens, None, session), 1).result(timeout=TIMEOUT_S)
        while (hits := self.client.query_prefetch_status(session).result(timeout=TIMEOUT_S)) is None:
            time.sleep(POLL_S)
        return hits

    def load(self, tokens: tuple[int, ...]) -> int:
        session = f"load-{next(_ids)}"
        hits = self.lookup(tokens, session)
        key = self.key(tokens, 0, session)
        reply = self.client.prepare_retrieve(key, self.instance_id).result(timeout=TIMEOUT_S)
        slots = reply.context["slots"] if reply.success else []
        for i, slot in enumerate(slots):
            offset = int(slot["offset"])
            self.host[i * self.value_bytes : (i + 1) * self.value_bytes] = self.shm[
                offset : offset + self.value_bytes
            ]
        self.client.commit_retrieve(key, self.instance_id).result(timeout=TIMEOUT_S)
        self.client.end_session(session)
        return min(hits, len(slots))

    def probe(self, tokens: tuple[int, ...]) -> int:
        """A scheduler's lookup: count, then release the locks at once."""
        session = f"probe-{next(_ids)}"
        hits = self.lookup(tokens, session)
        self.client.free_lookup_locks(self.key(tokens, None, session), 1)
        self.client.end_session(session)
        return hits

    def close(self) -> None:
        self.client.unregister_kv_cache_engine_driven_context(self.instance_id).result(timeout=TIMEOUT_S)
        self.segment.close()
        self.client.close()


class KVCoreSide:
    """kvcore's tier (worker) and index (scheduler) on one server; with ``engine``, values move between its
    blocks (stores from ``[0, chunks)``, loads into ``[chunks, 2 * chunks)``) and the slots directly."""

    def __init__(self, url: str, value_bytes: int, host: bytearray, engine: EngineKV | None = None) -> None:
        config = LMCacheMPConfig(url=url, request_timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S)
        model = f"kvcore-bench-{value_bytes}{'-blocks' if engine else ''}"
        self.value_bytes = value_bytes
        self.engine = engine
        block = engine.host_block_bytes if engine is not None else 1
        self.tier = LMCacheManagedTier(
            config,
            host if engine is None else None,
            value_bytes=value_bytes,
            chunk_tokens=CHUNK_TOKENS,
            model_name=model,
            block_movers=MappedMovers(engine) if engine is not None else None,
            block_bytes=block,
        )
        self.index = LMCacheChunkIndex(
            config, value_bytes=value_bytes, chunk_tokens=CHUNK_TOKENS, model_name=model, block_bytes=block
        )

    def items(self, keys: list[ChunkKey]) -> list[StoreItem]:
        return [StoreItem(key, i * self.value_bytes, self.value_bytes) for i, key in enumerate(keys)]

    def blocks(self, keys: list[ChunkKey], first: int) -> list[BlockItem]:
        per = BLOCKS_PER_CHUNK
        return [BlockItem(key, range(first + i * per, first + (i + 1) * per)) for i, key in enumerate(keys)]

    def ops(self, keys: list[ChunkKey]) -> dict[str, Callable[[], int]]:
        """The timed operations on one round's chunks; each returns how many chunks it handled."""
        return {
            "store": lambda: self.store(keys),
            "load": lambda: self.load(keys),
            "lookup": lambda: self.probe(keys),
        }

    def store(self, keys: list[ChunkKey]) -> int:
        session = RequestId("bench")
        if self.engine is None:
            job = self.tier.submit_store(session, self.items(keys))
        else:
            job = self.tier.submit_store_blocks(session, self.blocks(keys, 0))
        (result,) = self.tier.wait([job], TIMEOUT_S)
        return len(keys) - len(result.failed)

    def load(self, keys: list[ChunkKey]) -> int:
        session = RequestId(f"load-{next(_ids)}")
        lookup = self.tier.submit_lookup(session, keys)
        while (hits := self.tier.poll_lookup(lookup)) is None:
            time.sleep(POLL_S)
        if self.engine is None:
            job = self.tier.submit_retrieve(session, self.items(keys[:hits]))
        else:
            job = self.tier.submit_retrieve_blocks(
                session, self.blocks(keys[:hits], len(keys) * BLOCKS_PER_CHUNK)
            )
        (result,) = self.tier.wait([job], TIMEOUT_S)
        self.tier.end_session(session)
        return hits - len(result.failed)

    def probe(self, keys: list[ChunkKey]) -> int:
        lookup = self.index.submit_lookup([[key] for key in keys])
        while (hits := self.index.poll_lookup(lookup)) is None:
            time.sleep(POLL_S)
        return hits

    def close(self) -> None:
        self.index.close()
        self.tier.close()


def count_calls(url: str, size: int, chunks: int) -> tuple[Counter[str], Counter[str]]:
    """Server requests of one load of ``chunks`` stored chunks: kvcore's, LMCache's connector's."""
    rng = random.Random(size)
    kv_host, raw_host = bytearray(chunks * size), bytearray(chunks * size)
    kv, raw = KVCoreSide(url, size, kv_host, _engine(size, chunks)), RawSide(url, size, raw_host)
    try:
        keys = [ChunkKey(f"calls/{uuid.uuid4().hex[:8]}/{i}") for i in range(chunks)]
        tokens = tuple(rng.randrange(1, 1 << 30) for _ in range(chunks * CHUNK_TOKENS))
        if kv.store(keys) != chunks or raw.store(tokens) != chunks:
            raise RuntimeError("the chunks to load were not stored")
        counted = [CallCounter(kv.index.link.client), CallCounter(kv.tier.link.client)]
        kv.index.link.client = cast(RequestClient, counted[0])
        kv.tier.link.client = cast(RequestClient, counted[1])
        session = RequestId(f"calls-{next(_ids)}")
        # the scheduler's held lookup, its locks handed to the worker with the load (as the core does)
        lookup = kv.index.submit_held_lookup([[key] for key in keys])
        while (hits := kv.index.poll_lookup(lookup)) is None:
            time.sleep(POLL_S)
        held = kv.index.take_held(lookup)
        if hits != chunks or held is None or not kv.index.hand_over(held):
            raise RuntimeError("kvcore's lookup missed")
        kv.tier.adopt(session, held.holders[0], keys, held.start, held.end)
        blocks = kv.blocks(keys, chunks * BLOCKS_PER_CHUNK)
        (result,) = kv.tier.wait([kv.tier.submit_retrieve_blocks(session, blocks, keys)], TIMEOUT_S)
        kv.tier.end_session(session)
        lmcache = CallCounter(raw.client)
        raw.client = cast(RequestClient, lmcache)
        if result.failed or raw.load(tokens) != chunks:
            raise RuntimeError("a load missed")
        time.sleep(1.0)  # releases and session ends go out on a clean-up thread
        return counted[0].calls + counted[1].calls, Counter(lmcache.calls)  # before the closes below
    finally:
        kv.close()
        raw.close()


def _print_calls(url: str, chunks: int) -> None:
    ours, theirs = count_calls(url, SIZES[0], chunks)
    print(f"server requests of one load of {chunks} chunks (no host pool)")
    print(f"{'request':>34} {'kvcore':>7} {'lmcache':>8}")
    for name in sorted(set(ours) | set(theirs)):
        print(f"{name:>34} {ours[name]:>7} {theirs[name]:>8}")
    total = (sum(ours.values()), sum(theirs.values()))
    print(f"{'total':>34} {total[0]:>7} {total[1]:>8}")
    print(f"{'lookups per load':>34} {ours['lookup']:>7} {theirs['lookup']:>8}")
    print(f"{'requests per chunk':>34} {total[0] / chunks:>7.2f} {total[1] / chunks:>8.2f}")


def _timed(fn: Callable[[], int], expect: int) -> float:
    start = time.perf_counter()
    got = fn()
    elapsed = time.perf_counter() - start
    if got != expect:
        raise RuntimeError(f"expected {expect} chunks, got {got}")
    return elapsed


def _fill(host: bytearray, rng: random.Random) -> None:
    host[:] = rng.randbytes(len(host))


def _engine(size: int, chunks: int) -> EngineKV:
    """A CPU engine of one layer whose blocks (K and V of 16 tokens, one head) hold a value of ``size``
    bytes in ``BLOCKS_PER_CHUNK``."""
    head = size // (64 * BLOCKS_PER_CHUNK)
    layout = KVLayout(LayoutKind.VLLM_CPU, 2 * chunks * BLOCKS_PER_CHUNK, 16, 1, head, dtype_size=2)
    return EngineKV.register([torch.empty(layout.shape, dtype=torch.bfloat16)], layout)


def _engine_bytes(engine: EngineKV, first: int, count: int) -> bytes:
    (plane,) = engine.planes
    return bytes(plane[first : first + count].contiguous().view(torch.uint8).numpy().tobytes())


def run_size(
    url: str, size: int, chunks: int, repeats: int, blocks: bool
) -> dict[str, tuple[float, float, float]]:
    """Per operation: kvcore seconds, LMCache seconds (medians), median per-repeat ratio."""
    rng = random.Random(size)
    kv_host, raw_host = bytearray(chunks * size), bytearray(chunks * size)
    engine = _engine(size, chunks) if blocks else None
    kv, raw = KVCoreSide(url, size, kv_host, engine), RawSide(url, size, raw_host)
    times: dict[str, tuple[list[float], list[float]]] = {op: ([], []) for op in ("store", "load", "lookup")}
    try:
        for repeat in range(repeats + 1):  # the first round warms both sides up
            run = uuid.uuid4().hex[:8]
            keys = [ChunkKey(f"bench/{run}/{i}") for i in range(chunks)]
            tokens = tuple(rng.randrange(1, 1 << 30) for _ in range(chunks * CHUNK_TOKENS))
            _fill(kv_host, rng)
            raw_host[:] = kv_host
            if engine is not None:
                (plane,) = engine.planes
                source = plane[: chunks * BLOCKS_PER_CHUNK].view(torch.uint8).view(-1)
                source.copy_(torch.frombuffer(kv_host, dtype=torch.uint8))
            kv_ops, raw_ops = kv.ops(keys), raw.ops(tokens)
            for op in times:
                pair = [(kv_ops[op], 0), (raw_ops[op], 1)]
                if repeat % 2:
                    pair.reverse()  # alternate who goes first
                measured = [0.0, 0.0]
                for fn, side in pair:
                    measured[side] = _timed(fn, chunks)
                if repeat:
                    times[op][0].append(measured[0])
                    times[op][1].append(measured[1])
            per = BLOCKS_PER_CHUNK
            loaded = kv_host if engine is None else _engine_bytes(engine, chunks * per, chunks * per)
            if loaded != raw_host:
                raise RuntimeError("the two sides loaded different bytes")
    finally:
        kv.close()
        raw.close()
    return {
        op: (
            statistics.median(k),
            statistics.median(r),
            statistics.median(b / a for a, b in zip(k, r, strict=True)),
        )
        for op, (k, r) in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="one size, few repeats (seconds, plus the start)"
    )
    parser.add_argument("--chunks", type=int, default=32, help="chunks per operation")
    parser.add_argument("--blocks", action="store_true", help="kvcore moves engine blocks to the slots")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", action="store_true", help="count one load's server requests instead")
    parser.add_argument(
        "--url", help="use a running server (chunk size 256, --shm-name) instead of one's own"
    )
    args = parser.parse_args(argv)
    sizes = SIZES[:1] if args.quick else SIZES
    repeats = 3 if args.quick else args.repeats
    l1_gb = max(0.25, 2.5 * (repeats + 1) * args.chunks * max(sizes) / (1 << 30))
    with contextlib.ExitStack() as stack:
        if args.url:
            url, start_s = args.url, 0.0
        else:
            url, start_s = stack.enter_context(lmcache_server(l1_gb))
        print(f"lmcache server {url} (answered after {start_s:.1f}s)")
        if args.calls:
            _print_calls(url, args.chunks)
            return 0
        kvcore = "engine blocks <-> slots (block mover)" if args.blocks else "host buffer <-> slots"
        print(f"{args.chunks} chunks per operation, {repeats} repeats; kvcore: {kvcore}")
        print(f"{'value':>8} {'op':>7} {'kvcore':>12} {'lmcache':>12} {'ratio':>6}")
        for size in sizes:
            results = run_size(url, size, args.chunks, repeats, args.blocks)
            for op, (kv, raw, ratio) in results.items():
                if op == "lookup":
                    cells = f"{kv * 1e6:>9.0f} us {raw * 1e6:>9.0f} us"
                else:
                    volume = args.chunks * size / MiB
                    cells = f"{volume / kv:>7.0f} MiB/s {volume / raw:>7.0f} MiB/s"
                print(f"{size // KiB:>5}KiB {op:>7} {cells} {ratio:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
