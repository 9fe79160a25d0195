"""``kvcore demo``: a realistic workload through the engine-agnostic API on the embedded CPU backend.

A simulated engine (KV tensors of a real model's shape, vLLM's CPU layout, all layers in one storage)
serves multi-turn chats and agents. "Computing" a block writes bytes derived from the block's whole
prefix, so any block that comes back from kvcore can be checked byte for byte against what was saved: a
misplaced, stale or torn block cannot match. The summary reports hits, tokens served from cache vs
computed, bytes moved, copy throughput, pool usage and evictions, and the verification outcome.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Sequence

import numpy as np
import torch
from attrs import define, frozen

from kvcore.config import KVCoreConfig, load_config, parse_size
from kvcore.execution.worker import BlockWorker
from kvcore.ids import RequestId
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.step import StepPlan
from kvcore.plugins.compose import open_scheduler, open_worker
from kvcore.ports import Direction
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore_cli.progress import Progress
from kvcore_cli.workload import conversations

__all__ = ["DemoOptions", "DemoSummary", "run_demo"]


@frozen
class DemoOptions:
    chats: int = 24
    turns: int = 4
    seed: int = 0
    duration_s: float = 45.0
    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_tokens: int = 16
    chunk_tokens: int = 256
    engine_size: str = "1GiB"
    pool_size: str = "3GiB"
    progress: bool = True


@define
class DemoSummary:
    requests: int = 0
    requests_with_hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    loaded_bytes: int = 0
    saved_bytes: int = 0
    load_seconds: float = 0.0
    verified_blocks: int = 0
    mismatched_blocks: int = 0
    failed_blocks: int = 0
    pool_capacity: int = 0
    pool_used: int = 0
    evictions: int = 0
    wall_seconds: float = 0.0
    shape: str = ""

    @property
    def verified_ok(self) -> bool:
        return self.mismatched_blocks == 0

    def render(self) -> str:
        gib = 1 << 30
        hit_rate = self.requests_with_hits / max(self.requests, 1)
        token_rate = self.cached_tokens / max(self.prompt_tokens, 1)
        gbps = self.loaded_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0
        verdict = (
            f"OK: all {self.verified_blocks} loaded blocks equal, byte for byte, the KV that was saved"
            if self.verified_ok
            else f"FAILED: {self.mismatched_blocks} of {self.verified_blocks} loaded blocks differ"
        )
        rows = [
            ("model shape", self.shape),
            ("requests", f"{self.requests} ({hit_rate:.0%} with a cache hit) in {self.wall_seconds:.1f}s"),
            ("prompt tokens", f"{self.prompt_tokens}"),
            ("  served from cache", f"{self.cached_tokens} ({token_rate:.0%})"),
            ("  computed", f"{self.computed_tokens}"),
            (
                "bytes moved",
                f"{self.loaded_bytes / gib:.2f} GiB loaded, {self.saved_bytes / gib:.2f} GiB saved",
            ),
            ("load copy throughput", f"{gbps:.1f} GB/s"),
            ("pool", f"{self.pool_used}/{self.pool_capacity} chunks used, {self.evictions} evictions"),
            ("failed loads", f"{self.failed_blocks} blocks (recomputed)"),
            ("verification", verdict),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(["", "kvcore demo summary", *(f"  {k:<{width}}  {v}" for k, v in rows)])


class _Engine:
    """The simulated engine: KV memory, a block allocator, and deterministic "compute"."""

    def __init__(self, opts: DemoOptions) -> None:
        self.block_tokens = opts.block_tokens
        token_bytes = opts.layers * opts.kv_heads * 2 * opts.head_size * 2
        num_blocks = parse_size(opts.engine_size, "engine_size") // (token_bytes * opts.block_tokens)
        self.layout = KVLayout(
            kind=LayoutKind.VLLM_CPU,
            num_blocks=num_blocks,
            block_tokens=opts.block_tokens,
            num_kv_heads=opts.kv_heads,
            head_size=opts.head_size,
            dtype_size=2,
        )
        shape = (opts.layers, num_blocks, opts.kv_heads, opts.block_tokens, 2 * opts.head_size)
        self.storage = torch.zeros(shape, dtype=torch.bfloat16)
        self.tensors = list(self.storage.unbind(0))
        self.bytes = self.storage.view(torch.uint8).view(opts.layers, num_blocks, -1)
        gen = torch.Generator().manual_seed(opts.seed)
        ramp = torch.randint(0, 256, (1, opts.layers, self.bytes.shape[2]), dtype=torch.uint8, generator=gen)
        # 255 precomputed block contents (uint8 arithmetic wraps): computing or checking a block is then
        # one copy or one comparison at memory speed, with no allocation.
        self.patterns = (ramp + torch.arange(1, 256, dtype=torch.uint8).view(-1, 1, 1)).numpy()
        self.rows = self.bytes.numpy()  # numpy compares and copies strided rows at memory speed
        self.free = list(range(num_blocks))

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

    def release(self, blocks: Sequence[int]) -> None:
        self.free.extend(blocks)

    def _patterns(self, tokens: Sequence[int], first: int, stop: int) -> list[int]:
        """The patterns blocks ``[first, stop)`` of a request hold once computed: a function of the prefix."""
        out = []
        digest = hashlib.blake2b(digest_size=8)
        for j in range(stop):
            digest.update(array("I", tokens[j * self.block_tokens : (j + 1) * self.block_tokens]).tobytes())
            if j >= first:
                out.append(int.from_bytes(digest.copy().digest(), "little") % 255)
        return out

    def compute(self, tokens: Sequence[int], blocks: Sequence[int], first: int) -> None:
        for block, pattern in zip(blocks[first:], self._patterns(tokens, first, len(blocks)), strict=True):
            np.copyto(self.rows[:, block], self.patterns[pattern])

    def matches(self, tokens: Sequence[int], blocks: Sequence[int], first: int, stop: int) -> int:
        """How many of blocks ``[first, stop)`` hold exactly the bytes of their prefix."""
        patterns = self._patterns(tokens, first, stop)
        return sum(
            np.array_equal(self.rows[:, b], self.patterns[p])
            for b, p in zip(blocks[first:stop], patterns, strict=True)
        )


def _run_ops(
    sched: CacheScheduler, worker: BlockWorker, plan: StepPlan, timeout: float, summary: DemoSummary
) -> None:
    worker.execute(plan)
    loads = plan.op_ids(Direction.LOAD)
    if loads:
        start = time.perf_counter()
        reports = worker.wait(loads, timeout)
        summary.load_seconds += time.perf_counter() - start
    else:
        # a chat's next turn comes after its answer was read: its saves are done by then, however busy
        # the machine (a demo whose hits depended on the copy threads' speed would show none)
        reports = worker.wait(plan.op_ids(), timeout)
    sched.complete(reports)


def run_demo(opts: DemoOptions) -> DemoSummary:
    """Serve the workload; returns the summary (``verified_ok`` is False if any block came back wrong)."""
    engine = _Engine(opts)
    spec = EngineSpec(
        model_id="demo/llama-shape",
        kv_dtype="bfloat16",
        num_layers=opts.layers,
        total_kv_heads=opts.kv_heads,
        layout=engine.layout,
    )
    config: KVCoreConfig = load_config(
        {"backend": {"kind": "cpu", "size": opts.pool_size}, "chunk_tokens": opts.chunk_tokens}
    )
    sched = open_scheduler(config, spec)
    worker = open_worker(config, spec, engine.tensors)
    host_block = spec.host_block_bytes
    summary = DemoSummary(
        shape=(
            f"{opts.layers} layers x {opts.kv_heads} KV heads x {opts.head_size} head size, bf16, "
            f"{opts.block_tokens}-token blocks, {opts.chunk_tokens}-token chunks"
        )
    )
    turns = list(conversations(opts.chats, opts.turns, opts.seed))
    progress = Progress(len(turns), opts.progress)
    held: dict[RequestId, list[int]] = {}
    start = time.monotonic()
    try:
        for n, turn in enumerate(turns):
            if time.monotonic() - start > opts.duration_s:
                break
            rid = RequestId(f"req-{n}")
            tokens = turn.prompt + turn.answer
            hits = sched.lookup(rid, tokens=turn.prompt) or 0
            need = -(-len(tokens) // opts.block_tokens)
            blocks = engine.allocate(need)
            while blocks is None:  # wait for delayed frees of earlier requests
                sched.complete(worker.wait([], 0.01) + worker.reports())
                for done in sched.take_finished():
                    engine.release(held.pop(done))
                blocks = engine.allocate(need)
            loaded = sched.start_load(rid, blocks)
            _run_ops(sched, worker, sched.take_plan(), config.transfer_timeout_s, summary)
            failed = sched.take_load_errors().get(rid, ())
            loaded_stop = min((blocks.index(b) for b in failed), default=loaded // opts.block_tokens)
            good = engine.matches(turn.prompt, blocks, 0, loaded_stop) if loaded_stop else 0
            summary.verified_blocks += loaded_stop
            summary.mismatched_blocks += loaded_stop - good
            summary.failed_blocks += len(failed)
            engine.compute(tokens, blocks, loaded_stop)
            summary.requests += 1
            summary.requests_with_hits += hits > 0
            summary.prompt_tokens += len(turn.prompt)
            summary.cached_tokens += loaded_stop * opts.block_tokens
            summary.computed_tokens += len(tokens) - loaded_stop * opts.block_tokens
            summary.loaded_bytes += loaded_stop * host_block
            saved = sched.save(rid, blocks, num_tokens=len(tokens), tokens=tokens)
            summary.saved_bytes += saved * sched.blocks_per_chunk * host_block
            _run_ops(sched, worker, sched.take_plan(), config.transfer_timeout_s, summary)
            if sched.finish(rid):
                held[rid] = blocks
            else:
                engine.release(blocks)
            for done in sched.take_finished():
                engine.release(held.pop(done))
            usage = sched.pool.usage()
            hit_rate = summary.requests_with_hits / summary.requests
            progress.update(n + 1, f"hit {hit_rate:.0%}, pool {usage.used}/{usage.capacity}")
        while sched.in_flight():
            sched.complete(worker.wait([], 0.05) + worker.reports())
    finally:
        progress.close()
        worker.close()
    usage = sched.pool.usage()
    summary.pool_capacity, summary.pool_used, summary.evictions = usage.capacity, usage.used, usage.evictions
    summary.wall_seconds = time.monotonic() - start
    return summary
