"""``--cross-tp``: what a fuzz run's TP-1 engine wrote to its disk tier, read by an engine at another TP size.

The disk tier keeps a value per KV head, so a chunk written at one TP size serves any other. During the
run, the prompts saved since the last reset are noted as they stood (their tokens, block hashes, salt and
KV epoch: the oracle's KV is a function of them). After the run (kvcore closed: a disk written back
holds the pool's chunks too), kvcore is composed again over the same directory for the same model at
TP 2 or 4 (``reader_tp``: the run's two KV heads split, or each replicated on two ranks) and the
writer's last key epoch, one worker per rank over engine blocks of one head each, and each noted prompt
is looked up and loaded. Whatever it finds (the disk evicts, faults failed saves), every block a rank
loaded must hold the oracle's KV of that rank's head; a block whose load is reported failed is not
checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
import torch

from kvcore.config import load_config
from kvcore.ids import RequestId
from kvcore.keying.hashing import ExtraKeys
from kvcore.model.engine import EngineSpec
from kvcore.plugins.compose import open_scheduler, open_worker
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore_cli.fuzz.oracle import KVOracle
from kvcore_cli.fuzz.requests import BLOCK_TOKENS, Request
from kvcore_cli.fuzz.results import FuzzSummary
from kvcore_cli.fuzz.trace import Trace
from kvcore_cpu.tier import CPUWorker

__all__ = ["WrittenPrompts", "read_at_another_tp", "reader_settings", "reader_tp"]

MAX_PROMPTS = 64  # prompts noted (the first ones saved): each is a lookup and a load of the reader
WAIT_S = 10.0
CHUNK_SLOTS = 8  # the reader's pool, in chunks per rank: every load stages through it


class WrittenPrompts:
    """The last ``MAX_PROMPTS`` prompts saved since the last reset, as they stood at their save (the
    engine's requests grow, and a reset changes their KV and kvcore's keys)."""

    def __init__(self, key_epoch: Callable[[], str]) -> None:
        self.prompts: dict[tuple[str | None, bool, tuple[int, ...]], Request] = {}
        self.epoch = 0
        self._key_epoch = key_epoch
        self.key_epoch = key_epoch()  # kvcore's, under which the noted prompts were saved

    def note(self, req: Request) -> None:
        """A save of ``req``'s computed tokens was planned (``key_epoch`` tells kvcore's epoch now)."""
        if req.epoch > self.epoch:
            self.prompts.clear()
            self.epoch = req.epoch
            self.key_epoch = self._key_epoch()
        blocks = req.computed // BLOCK_TOKENS
        key = (req.chat.salt, req.chat.by_hashes, tuple(req.tokens[: blocks * BLOCK_TOKENS]))
        if req.epoch < self.epoch or not blocks or key in self.prompts:
            return
        if len(self.prompts) >= MAX_PROMPTS:
            del self.prompts[next(iter(self.prompts))]
        self.prompts[key] = attrs.evolve(
            req,
            rid=RequestId(f"cross-tp-{len(self.prompts)}"),
            tokens=list(key[2]),
            hashes=req.hashes[:blocks],
        )


def reader_tp(seed: int) -> int:
    """The reader's TP size for the run of ``seed``: 2 and 4 in turn (the writer's heads split, or
    replicated)."""
    return 2 << seed % 2


def read_at_another_tp(
    written: WrittenPrompts,
    spec: EngineSpec,
    settings: dict[str, object],
    oracle: KVOracle,
    summary: FuzzSummary,
    trace: Trace,
    hash_identity: str,
    tp: int,
) -> None:
    """Load every noted prompt at TP ``tp`` through the disk tier ``settings`` (with the writer's key
    epoch), checking each loaded block of each rank against the oracle; counts into ``summary``."""
    total = spec.total_kv_heads
    heads = max(total // tp, 1)
    layout = attrs.evolve(spec.layout, num_kv_heads=heads)
    reader = attrs.evolve(spec, layout=layout, tp_size=tp)
    # vLLM's head ownership: each rank its run of heads, or (more ranks than heads) a replica of one
    firsts = [rank * heads if tp <= total else rank // (tp // total) for rank in range(tp)]
    config = load_config(settings)
    sched = open_scheduler(config, reader, hash_identity=hash_identity)
    storage = [torch.zeros((reader.num_layers, *layout.shape), dtype=torch.bfloat16) for _ in range(tp)]
    workers: list[CPUWorker] = []
    try:
        for rank in range(tp):
            worker = open_worker(config, reader, list(storage[rank].unbind(0)), rank=rank)
            assert isinstance(worker, CPUWorker)
            workers.append(worker)
        for req in written.prompts.values():
            _read_one(req, sched, workers, storage, firsts, heads, oracle, summary, trace)
    finally:
        for worker in workers:
            worker.close()
        sched.close()


def _read_one(
    req: Request,
    sched: CacheScheduler,
    workers: list[CPUWorker],
    storage: list[torch.Tensor],
    firsts: list[int],
    heads: int,
    oracle: KVOracle,
    summary: FuzzSummary,
    trace: Trace,
) -> None:
    extra = ExtraKeys(cache_salt=req.chat.salt)
    num_tokens = len(req.tokens) + 1  # one token more: the engine computes the prompt's last itself
    deadline = time.monotonic() + WAIT_S
    while True:
        if req.chat.by_hashes:
            hits = sched.lookup(
                req.rid,
                block_hashes=req.hashes,
                hash_block_tokens=BLOCK_TOKENS,
                num_tokens=num_tokens,
                extra=extra,
            )
        else:
            hits = sched.lookup(req.rid, tokens=[*req.tokens, 0], extra=extra)
        if hits is not None or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    trace.note(f"cross-tp lookup {req.rid} ({len(req.tokens)} tokens, salt {req.chat.salt}) -> {hits}")
    blocks = list(range(-(-num_tokens // BLOCK_TOKENS)))
    if hits:
        sched.start_load(req.rid, blocks)
        _step(sched, workers)
        failed = set(sched.take_load_errors().get(req.rid, ()))
        for j in range(hits // BLOCK_TOKENS):
            if blocks[j] in failed:
                continue
            want = oracle.slots(req, j, (j + 1) * BLOCK_TOKENS)  # [layer, head, slot, bytes]
            for rank, kv in enumerate(storage):
                got = kv[:, blocks[j]].view(torch.uint8).numpy()  # [layer, head of the rank, slot, bytes]
                own = want[:, firsts[rank] : firsts[rank] + heads]
                if not np.array_equal(got, own):
                    trace.fail(
                        req.rid,
                        f"read at TP {len(storage)}: rank {rank}'s block {j} holds {oracle.whose(got)}; "
                        f"expected {oracle.whose(own)}",
                    )
            summary.cross_tp_blocks += 1
        summary.cross_tp_loads += 1
    sched.finish(req.rid)
    _step(sched, workers)
    summary.cross_tp_prompts += 1


def _step(sched: CacheScheduler, workers: list[CPUWorker]) -> None:
    """One engine step's plan, executed by every rank and reported back."""
    plan = sched.take_plan()
    for worker in workers:
        worker.execute(plan)
    for worker in workers:
        sched.complete(worker.wait(plan.op_ids(), WAIT_S))


def reader_settings(
    path: Path, size: int, chunk_tokens: int, tails: bool, slot_bytes: int, epoch: str
) -> dict[str, object]:
    """The reader's config: the run's disk directory (its size, so that opening it evicts nothing), and
    the key epoch the writer ended in (the one its last reset moved it to)."""
    return {
        "epoch": epoch,
        "backend": {
            "kind": "disk",
            "path": str(path),
            "size": size,
            "local_size": CHUNK_SLOTS * slot_bytes,
            "io_threads": 1,
        },
        "chunk_tokens": chunk_tokens,
        "partial_chunks": "keep" if tails else "drop",
    }
