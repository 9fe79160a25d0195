"""Per-block checksums on the CPU tier: damaged host bytes are a failed load (a miss), never loaded KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcore.config import load_config
from kvcore.errors import UsageError
from kvcore.execution.remote import StoreRemote
from kvcore.ids import ChunkKey, RequestId
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.plugins.sizing import pool_slots
from kvcore.ports import BlockTransfer, Direction, StoreItem
from kvcore.scheduling.scheduler import CacheScheduler
from kvcore.testing.support import wait_one
from kvcore_cpu import EngineKV, HostMemory, TorchBlockMover
from kvcore_cpu.tier import CPUWorker, open_rank
from kvcore_disk.directory import ChunkDirectory
from kvcore_disk.store import DiskChunkStore

LAYOUT = KVLayout(
    kind=LayoutKind.VLLM_CPU, num_blocks=32, block_tokens=16, num_kv_heads=2, head_size=32, dtype_size=2
)
ENGINE = EngineSpec(model_id="tiny", kv_dtype="bfloat16", num_layers=2, total_kv_heads=2, layout=LAYOUT)
TOKENS = list(range(1000, 1100))  # 100 tokens: 3 chunks of 32


def _rig(checksums: bool) -> tuple[CacheScheduler, CPUWorker, list[torch.Tensor]]:
    config = load_config(
        {"backend": {"kind": "cpu", "size": "4MiB"}, "chunk_tokens": 32, "checksums": checksums}
    )
    kv = [torch.randn(LAYOUT.shape).to(torch.bfloat16) for _ in range(2)]
    return CacheScheduler(config, ENGINE, pool_slots(config, ENGINE)), open_rank(config, ENGINE, kv), kv


def _step(sched: CacheScheduler, worker: CPUWorker) -> None:
    plan = sched.take_plan()
    worker.execute(plan)
    sched.complete(worker.wait(plan.op_ids(), 10.0))


def _save_then_load(checksums: bool, damage: bool) -> tuple[CacheScheduler, CPUWorker, list[torch.Tensor]]:
    sched, worker, kv = _rig(checksums)
    sched.lookup(RequestId("a"), tokens=TOKENS)
    sched.save(RequestId("a"), list(range(7)), num_tokens=100)
    _step(sched, worker)
    sched.finish(RequestId("a"))
    if damage:  # out of band: flip every byte the pool holds
        assert worker.host is not None
        worker.host.buffer.bitwise_not_()
    assert sched.lookup(RequestId("b"), tokens=TOKENS) == 96
    sched.start_load(RequestId("b"), list(range(10, 17)))
    _step(sched, worker)
    return sched, worker, kv


def test_intact_blocks_load_with_checksums_on() -> None:
    sched, worker, kv = _save_then_load(checksums=True, damage=False)
    try:
        assert sched.take_load_errors() == {}
        assert all(torch.equal(layer[0:6], layer[10:16]) for layer in kv)
    finally:
        worker.close()


def test_damage_is_detected_and_the_chunks_dropped() -> None:
    sched, worker, kv = _save_then_load(checksums=True, damage=True)
    try:
        errors = sched.take_load_errors()[RequestId("b")]
        assert sorted(errors) == list(range(10, 16))  # every loaded block: recompute
        assert worker.checksums is not None
        assert worker.checksums.mismatches == 6
        assert not any(torch.equal(layer[0:1], layer[10:11]) for layer in kv)  # nothing was copied in
        assert sched.lookup(RequestId("c"), tokens=TOKENS) == 0  # and nothing is served again
    finally:
        worker.close()


def test_without_checksums_damage_reaches_the_engine() -> None:
    # the control: the same damage, unchecked, is loaded (which is why checksums exist)
    sched, worker, kv = _save_then_load(checksums=False, damage=True)
    try:
        assert sched.take_load_errors() == {}
        assert not torch.equal(kv[0][0:6], kv[0][10:16])
    finally:
        worker.close()


def test_a_worker_built_with_checksums_and_a_remote_tier_is_refused(tmp_path: Path) -> None:
    # a fetched chunk carries no digest: every load would fail; refused by name, nothing taken over
    kv = EngineKV.register([torch.zeros(LAYOUT.shape, dtype=torch.bfloat16) for _ in range(2)], LAYOUT)
    host = HostMemory.allocate(8, kv.host_block_bytes, kv.device)
    mover = TorchBlockMover(kv, host)
    store = DiskChunkStore(ChunkDirectory.open(tmp_path, 1 << 20), host.buffer.numpy().data)
    remote = StoreRemote(store)
    try:
        with pytest.raises(UsageError, match=r"checksums: got True with a remote tier \(StoreRemote\)"):
            CPUWorker(mover, kv, host, 0, checksums=True, remote=remote, slot_bytes=2 * kv.host_block_bytes)
        # the caller still holds a working mover and tier
        assert wait_one(mover, mover.submit(BlockTransfer(Direction.SAVE, [0], [0]))).ok
        item = StoreItem(ChunkKey("kv/a"), 0, kv.host_block_bytes)
        assert wait_one(remote, remote.submit_publish("r", [item])).ok
    finally:
        remote.close()
        mover.close()
        host.close()
