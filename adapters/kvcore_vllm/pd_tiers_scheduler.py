"""The scheduler side of a connector that serves P/D and tiers at once (``KVCoreConnector`` with a ``pd``
section): one answer to vLLM per request, whatever the number of sources.

A decode request (``do_remote_prefill``) combines its sources in order: vLLM's own prefix cache (the
``num_computed_tokens`` vLLM asks with), then the tiers (their longest prefix past it), then the producer
for the rest of the prompt only; a block found locally or in a tier is never pulled. The producer is asked
with the tiers' hit counted as computed, so its rule (a block boundary to the prompt's end) starts where
the tiers stop; where the tiers hold the whole prompt, the producer is only told to free its blocks.
Where the producer owes blocks the whole load is asynchronous: the tiers' part is loaded alongside the
pull and the worker side (``PDTiersWorker``) reports the request received once, when every
source that owed blocks has reported; a failed source's blocks are load errors: vLLM recomputes from the
first failed block on, whichever source owed the blocks after it.

A hybrid model's groups (sliding-window and full attention) are the tiers' ``GroupedSchedulerSide`` (one
hit every group serves) and the P/D scheduler's block tables, one per group; vLLM then takes a failed
source by request and recomputes the request.

Every other request is the tiers' alone, a prefill request (``do_remote_decode``) included: it is saved
as it computes (per the tiers' store policy), and its finished blocks are also held for the consumer. Its
params say how many of its prompt tokens the tiers served (``remote_tier_tokens``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from kvcore.scheduling.scheduler import SchedulerStats
from kvcore_vllm.grouped_scheduler import GroupedSchedulerSide
from kvcore_vllm.pd_metadata import PDTiersMetadata
from kvcore_vllm.pd_params import wants_remote_prefill
from kvcore_vllm.pd_scheduler import PDScheduler
from kvcore_vllm.scheduler_side import SchedulerSide

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TIER_TOKENS_KEY", "PDTiersScheduler"]

TIER_TOKENS_KEY = "remote_tier_tokens"
"""The key of a prefill's params that says how many of its prompt tokens came from the tiers."""


class PDTiersScheduler:
    """The tiers' scheduler side (of one KV-cache group, or of several) and the P/D scheduler, combined
    per request."""

    def __init__(self, tiers: SchedulerSide | GroupedSchedulerSide, pd: PDScheduler) -> None:
        self.tiers = tiers
        self.pd = pd
        # decode requests the producer was asked for: the tiers' hit, until allocation splits the load
        self._tier_hits: dict[str, int] = {}
        self._pulled: dict[str, int] = {}  # tokens the producer owes a request, until vLLM counts its hits

    @property
    def halted_ranks(self) -> set[int]:
        return self.tiers.halted_ranks

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        hits, is_async = self.tiers.get_num_new_matched_tokens(request, num_computed_tokens)
        if hits is None or not (self.pd.role.consumes and wants_remote_prefill(request.kv_transfer_params)):
            return hits, is_async
        covered = num_computed_tokens + hits
        if covered >= request.num_prompt_tokens - 1:
            # every token but the last, which vLLM computes anyway, is held: nothing to pull (at the end
            # of the last block, so that the producer is asked for nothing and only told to free its own)
            covered = -(-request.num_prompt_tokens // self.pd.block_tokens) * self.pd.block_tokens
        pulled, _ = self.pd.get_num_new_matched_tokens(request, covered)
        if not pulled:
            self._tier_hits.pop(request.request_id, None)
            return hits, is_async
        self._tier_hits[request.request_id] = hits
        # vLLM waits for the request as a whole: the tiers' part loads asynchronously too
        self.tiers.settle(request.request_id, None, True)
        return hits + pulled, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        hits = self._tier_hits.pop(request.request_id, num_external_tokens)
        tiers = min(hits, num_external_tokens)
        tables = blocks.get_block_ids()
        if isinstance(self.tiers, GroupedSchedulerSide):
            self.tiers.update_state_after_alloc(request, tables, tiers)
        else:
            self.tiers.update_state_after_alloc(request, tables[0], tiers)
        self.pd.update_state_after_alloc(request, blocks, num_external_tokens - tiers)
        if num_external_tokens > tiers:
            self._pulled[request.request_id] = num_external_tokens - tiers

    def tracked(self) -> int:
        """Requests this side keeps something for between vLLM's calls: 0 once every request ended."""
        return len(self._tier_hits.keys() | self._pulled.keys()) + self.pd.tracked()

    def take_pulled(self, request_id: str) -> int:
        """Of the request's external tokens just allocated, those the producer owes (vLLM's hits by
        source: the rest are the tiers')."""
        return self._pulled.pop(request_id, 0)

    def build_connector_meta(self, out: SchedulerOutput) -> PDTiersMetadata:
        return PDTiersMetadata(self.tiers.build_connector_meta(out), self.pd.build_connector_meta())

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.tiers.update_connector_output(output)
        self.pd.update_connector_output(output)

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Either side may keep the blocks (the tiers' saves in flight, the producer's offer, a pull still
        writing them): vLLM frees them once the worker side reported every side that kept them.
        ``block_ids`` are the request's blocks in every KV-cache group."""
        self._tier_hits.pop(request.request_id, None)
        self._pulled.pop(request.request_id, None)
        served = self.tiers.extra_cached_tokens(request.request_id)
        if isinstance(self.tiers, GroupedSchedulerSide):
            tiers_delay, tiers_params = self.tiers.request_finished(request, block_ids)
        else:
            tiers_delay, tiers_params = self.tiers.request_finished(request, block_ids[0])
        pd_delay, pd_params = self.pd.request_finished(request, block_ids)
        if pd_params is not None:
            pd_params[TIER_TOKENS_KEY] = served
        params = {**(tiers_params or {}), **(pd_params or {})}
        return tiers_delay or pd_delay, params or None

    def loaded_groups(self) -> tuple[int, ...]:
        return self.tiers.loaded_groups() if isinstance(self.tiers, GroupedSchedulerSide) else (0,)

    def reset_cache(self) -> bool:
        return self.tiers.reset_cache()

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        self.tiers.bind_gpu_block_pool(pool)

    def take_events(self) -> list[KVCacheEvent]:
        return self.tiers.take_events()

    def stats(self) -> SchedulerStats:
        """The tiers' stats, whose ``requests`` count the requests either side keeps something for (a
        decode request P/D still pulls for after the tiers ended it, too), each once."""
        tracked = self.tiers.tracked_requests() | self.pd.tracked_requests()
        return attrs.evolve(self.tiers.stats(), requests=len(tracked))

    def close(self) -> None:
        self.tiers.close()
