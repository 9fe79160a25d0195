"""The connector's scheduler side (vLLM's engine-core process): vLLM's hooks translated to the core.

Chunk keys come from ``request.block_hashes`` (nothing is re-hashed); lookups, load specs, slot
bookkeeping and the step's copies are ``kvcore.scheduler.CacheScheduler``'s. This module only keeps what
vLLM does not hand back each step: each request's block table and the live ``Request`` objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcore.config import KVCoreConfig
from kvcore.engine import EngineSpec
from kvcore.ids import RequestId
from kvcore.scheduler import SchedulerStats
from kvcore_vllm.compose import scheduler_core
from kvcore_vllm.metadata import KVCoreMetadata, KVCoreWorkerMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["EXTRA_CACHED_KEYS", "SchedulerSide"]

# kv_transfer_params keys a request sets to get the tokens served from kvcore back (the second for
# drop-in compatibility with LMCache's connector).
EXTRA_CACHED_KEYS = ("num_extra_cached_tokens", "num_lmcache_extra_cached_tokens")


class SchedulerSide:
    def __init__(
        self, config: KVCoreConfig, engine: EngineSpec, hash_block_tokens: int, hash_identity: str
    ) -> None:
        self.core = scheduler_core(config, engine, hash_identity)
        self._hash_block_tokens = hash_block_tokens
        self._requests: dict[str, Request] = {}
        self._blocks: dict[str, list[int]] = {}
        self._delayed: list[str] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = RequestId(request.request_id)
        self._requests[request.request_id] = request
        hits = self.core.lookup(
            rid,
            block_hashes=request.block_hashes,
            hash_block_tokens=self._hash_block_tokens,
            num_tokens=request.num_tokens,
            local_tokens=num_computed_tokens,
        )
        return hits, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens > 0:
            self.core.start_load(RequestId(request.request_id), blocks.get_block_ids()[0])

    def build_connector_meta(self, out: SchedulerOutput) -> KVCoreMetadata:
        for new in out.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            self._save(new.req_id, new.num_computed_tokens + out.num_scheduled_tokens.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self._blocks[rid] = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                self._blocks.setdefault(rid, []).extend(new_ids[0])
            self._save(rid, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(rid, 0))
        preempted = tuple(out.preempted_req_ids or ())
        for rid in preempted:
            self.core.preempt(RequestId(rid))
            self._blocks.pop(rid, None)
        # workers report their own failed copies in the step that detects them; only the blocks the
        # scheduler gave up on before any copy travel to them
        lost = self.core.take_lost_blocks()
        meta = KVCoreMetadata(self.core.take_plan(), tuple(self._delayed), preempted, lost)
        self._delayed.clear()
        return meta

    def _save(self, rid: str, computed_tokens: int) -> None:
        request = self._requests.get(rid)
        blocks = self._blocks.get(rid)
        if request is None or not blocks:
            return
        real = min(computed_tokens, request.num_tokens) - request.num_output_placeholders
        self.core.save(
            RequestId(rid),
            blocks,
            num_tokens=real,
            block_hashes=request.block_hashes,
            hash_block_tokens=self._hash_block_tokens,
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVCoreWorkerMetadata):
            self.core.complete(meta.reports)
        self.core.take_finished()  # retirements are vLLM's to report (finished_sending); drop ours

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = RequestId(request.request_id)
        params = None
        asked = request.kv_transfer_params or {}
        wanted = [k for k in EXTRA_CACHED_KEYS if k in asked]
        if wanted:
            extra = self.core.extra_cached_tokens(rid)
            params = dict.fromkeys(wanted, extra)
        delay = self.core.finish(rid)
        if delay:
            self._delayed.append(request.request_id)
        self._requests.pop(request.request_id, None)
        self._blocks.pop(request.request_id, None)
        return delay, params

    def reset_cache(self) -> bool:
        self.core.reset()
        return True

    def stats(self) -> SchedulerStats:
        return self.core.stats()
