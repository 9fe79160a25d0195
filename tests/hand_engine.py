"""Engines stepped by hand, for the tests of a remote tier: a scheduler and its ranks' workers, each as
the vLLM adapter composes them (``kvcore.plugins.compose``), over random KV in CPU engine blocks. The config
decides the tier (and whether a host pool stands between the engine's blocks and it)."""

from __future__ import annotations

import time
import uuid

import torch

from kvcore.config import KVCoreConfig
from kvcore.ids import RequestId
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.model.step import StepPlan
from kvcore.plugins.compose import open_scheduler, open_worker
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore.testing.support import SETTLE_S
from kvcore_cpu.tier import CPUWorker

CHUNK_TOKENS = 128
BLOCK = 32  # tokens per engine block: a chunk is CHUNK_TOKENS // BLOCK blocks
PER_CHUNK = CHUNK_TOKENS // BLOCK
CHUNKS = 3
ENGINE_BLOCKS = 64


def engine_spec(tp: int, kv_heads: int | None = None) -> EngineSpec:
    """A model of ``kv_heads`` KV heads (two per rank by default; fewer than ``tp``: ranks share them) at
    TP ``tp``, under a model name of its own."""
    total = 2 * tp if kv_heads is None else kv_heads
    layout = KVLayout(
        LayoutKind.VLLM_CPU,
        num_blocks=ENGINE_BLOCKS,
        block_tokens=BLOCK,
        num_kv_heads=max(total // tp, 1),
        head_size=16,
        dtype_size=2,
    )
    model = f"org/direct-{uuid.uuid4().hex[:8]}"
    return EngineSpec(model, "bfloat16", num_layers=2, total_kv_heads=total, layout=layout, tp_size=tp)


class Engine:
    """A scheduler and one worker per rank over random KV, stepped by hand."""

    def __init__(self, config: KVCoreConfig, spec: EngineSpec, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.spec = spec
        self.sched: CacheScheduler = open_scheduler(config, spec, hash_identity="test-hashes")
        self.plans: list[StepPlan] = []
        self.workers: list[CPUWorker] = []
        for rank in range(spec.tp_size):
            bits = torch.randint(-(2**15), 2**15, spec.layout.shape, dtype=torch.int16, generator=generator)
            kv = [bits.view(torch.bfloat16).clone() for _ in range(spec.num_layers)]
            worker = open_worker(config, spec, kv, rank=rank)
            assert isinstance(worker, CPUWorker)
            self.workers.append(worker)

    def step(self) -> None:
        plan = self.sched.take_plan()
        self.plans.append(plan)
        for worker in self.workers:
            worker.execute(plan)
        for worker in self.workers:
            self.sched.complete(worker.wait(plan.op_ids(), 2 * SETTLE_S))
        assert self.sched.in_flight() == 0

    def lookup(self, request: str, tokens: list[int], local_tokens: int = 0) -> int:
        deadline = time.monotonic() + SETTLE_S
        while (
            hits := self.sched.lookup(RequestId(request), tokens=tokens, local_tokens=local_tokens)
        ) is None:
            assert time.monotonic() < deadline, "the lookup never answered"
            time.sleep(0.005)
        return hits

    def blocks(self, rank: int, ids: range) -> list[bytes]:
        return [self.workers[rank].engine_block_bytes(b) for b in ids]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.sched.close()


def prompt(seed: int, tail_blocks: int = 0) -> list[int]:
    """A prompt of ``CHUNKS`` chunks, ``tail_blocks`` whole blocks (a tail) and a few tokens."""
    return [(seed * 7919 + 31 * i) % 30000 for i in range(CHUNKS * CHUNK_TOKENS + tail_blocks * BLOCK + 5)]


def save(engine: Engine, request: str, tokens: list[int]) -> None:
    """Compute-and-save ``tokens`` as request ``request`` of ``engine``, from its blocks 0 on: its whole
    chunks and its tail (the whole blocks after them), if it has one."""
    assert engine.lookup(request, tokens) == 0
    chunks, rest = divmod(len(tokens), CHUNK_TOKENS)
    blocks = list(range(-(-len(tokens) // BLOCK)))
    assert engine.sched.save(RequestId(request), blocks, len(tokens)) == chunks + (rest >= BLOCK)
    engine.step()
    assert engine.sched.stats().failed_save_chunks == 0
