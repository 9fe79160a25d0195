"""Fencing on the real CPU tier (``open_rank``: torch tensors, the copy thread): a preempted request's
save that has not been reported keeps nothing, whatever the copy thread did, and one already reported
kept the request's own bytes. The engine follows docs/engine-api.md: it executes each plan before it
reuses a freed block."""

from __future__ import annotations

import torch

from kvcore.config import load_config
from kvcore.ids import RequestId
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.plugins.sizing import pool_slots
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore_cpu import open_rank

LAYOUT = KVLayout(
    kind=LayoutKind.FLASH_INFER,
    num_blocks=32,
    block_tokens=16,
    num_kv_heads=2,
    head_size=32,
    dtype_size=2,
    head_order=HeadOrder.NHD,
)
ENGINE = EngineSpec(model_id="trust", kv_dtype="bfloat16", num_layers=2, total_kv_heads=2, layout=LAYOUT)
CONFIG = load_config({"backend": {"kind": "cpu", "size": "4MiB"}, "chunk_tokens": 32})
PROMPT = list(range(1000, 1100))  # 3 full chunks and 4 tokens


def _kv() -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.shape, dtype=torch.bfloat16) for _ in range(ENGINE.num_layers)]


def _write(kv: list[torch.Tensor], blocks: range, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in kv:
        layer[list(blocks)] = torch.randn(len(blocks), *LAYOUT.shape[1:], generator=gen).to(torch.bfloat16)


def test_a_preempted_requests_unreported_save_keeps_nothing_on_the_cpu_tier() -> None:
    kv = _kv()
    sched = CacheScheduler(CONFIG, ENGINE, pool_slots(CONFIG, ENGINE))
    worker = open_rank(CONFIG, ENGINE, kv)
    try:
        a = RequestId("a")
        assert sched.lookup(a, tokens=PROMPT) == 0
        _write(kv, range(7), seed=1)
        assert sched.save(a, range(7), num_tokens=len(PROMPT)) == 3
        worker.execute(sched.take_plan())  # the copy thread may run it at once, or later
        sched.preempt(a)
        fence = sched.take_plan()
        assert len(fence.fenced) == 1
        worker.execute(fence)
        _write(kv, range(7), seed=2)  # the freed blocks get another request's KV
        sched.complete(worker.wait([*fence.fenced], 10.0))
        assert sched.stats().ops_in_flight == 0
        assert sched.lookup(RequestId("b"), tokens=PROMPT) == 0  # nothing of either was kept
    finally:
        worker.close()


def test_a_save_reported_before_the_preemption_is_kept_and_loads_bit_exact() -> None:
    kv = _kv()
    sched = CacheScheduler(CONFIG, ENGINE, pool_slots(CONFIG, ENGINE))
    worker = open_rank(CONFIG, ENGINE, kv)
    try:
        a = RequestId("a")
        assert sched.lookup(a, tokens=PROMPT) == 0
        _write(kv, range(7), seed=1)
        original = [layer[0:6].clone() for layer in kv]
        sched.save(a, range(7), num_tokens=len(PROMPT))
        plan = sched.take_plan()
        worker.execute(plan)
        sched.complete(worker.wait(plan.op_ids(), 10.0))  # reported: the copy is done
        sched.preempt(a)
        worker.execute(sched.take_plan())
        _write(kv, range(7), seed=2)
        b = RequestId("b")
        assert sched.lookup(b, tokens=PROMPT) == 96
        sched.start_load(b, range(10, 17))
        plan = sched.take_plan()
        worker.execute(plan)
        sched.complete(worker.wait(plan.op_ids(), 10.0))
        assert sched.take_load_errors() == {}
        assert all(torch.equal(layer[10:16], saved) for layer, saved in zip(kv, original, strict=True))
    finally:
        worker.close()
