"""The scheduler side for a model of several KV-cache groups (vLLM's hybrid KV-cache manager, HMA).

A hybrid model (Gemma 3, gpt-oss: sliding-window and full attention layers) keeps one block table per
group. Each group is served by its own ``SchedulerSide``: its own core, keys (``KVGroup.engine`` names the
group), slots and block tables. This side makes them answer vLLM as one:

- **one hit every group serves**: each group's lookup finds what it can load (a full attention group its
  leading chunks; a sliding-window group over a pool alone, the highest stop whose last window it holds,
  ``EngineSpec.window_tokens``), and vLLM is told the least of them, lowered until every group serves it
  (``CacheScheduler.cap_load``; a group that holds less lowers the hit, never serves a block it does not
  have); every load is asynchronous: vLLM takes load failures of a model of several groups by request
  only (``failed_recving``, for a request waiting for its load), and recomputes the request.
- a sliding-window group loads only the blocks vLLM holds for it, those of the hit's last window: vLLM
  gives the blocks before the window as its null block, which the load skips; its saves skip chunks with
  a block vLLM freed (read from vLLM's current tables), and a save reading a block that vLLM hands out
  again is waited for before the forward pass writes it (``KVCoreMetadata.reused``).
- a request ends in every group at once; vLLM keeps its blocks while any group's saves run.

Counters of blocks and chunks are the groups' sums; counters of requests (lookups, asynchronous loads,
live requests) the most any group counted, as every group sees every request; hit tokens the least any
group loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvcore.pool.block_pool import PoolUsage
from kvcore.scheduling.scheduler import SchedulerStats
from kvcore_vllm.metadata import GroupedMetadata, GroupedWorkerMetadata
from kvcore_vllm.scheduler_side import SchedulerSide

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["GroupedSchedulerSide", "merge_stats"]

_PER_REQUEST = ("lookups", "async_loads", "requests")
_SUMMED = (
    "loaded_blocks",
    "saved_blocks",
    "failed_load_blocks",
    "failed_save_chunks",
    "save_retries",
    "ops_in_flight",
    "written_back_chunks",
    "failed_write_back_chunks",
    "assembled_chunks",
)


class GroupedSchedulerSide:
    """One ``SchedulerSide`` per KV-cache group, in vLLM's group order, answering vLLM as one."""

    def __init__(self, sides: Sequence[SchedulerSide]) -> None:
        self.sides = tuple(sides)

    @property
    def halted_ranks(self) -> set[int]:
        return set().union(*(side.halted_ranks for side in self.sides))

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        for side in self.sides:
            side.bind_gpu_block_pool(pool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answers = [side.get_num_new_matched_tokens(request, num_computed_tokens) for side in self.sides]
        found = [hits for hits, _ in answers]
        if None in found:
            return None, False  # a group's remote lookup is pending; every group's answer is kept
        hit = min(hits for hits in found if hits is not None)
        agreed = None
        while agreed != hit:  # a sliding-window group may serve less than asked: ask every group again
            agreed = hit
            hit = min(side.cap(request.request_id, hit) for side in self.sides)
        is_async = hit > 0  # vLLM takes a failure by request only from an asynchronous load
        for side in self.sides:
            side.settle(request.request_id, hit, is_async)
        return hit, is_async

    def settle(self, rid: str, hits: int | None, is_async: bool) -> None:
        """Every group's ``SchedulerSide.settle``."""
        for side in self.sides:
            side.settle(rid, hits, is_async)

    def extra_cached_tokens(self, rid: str) -> int:
        """The request's prompt tokens the tiers served in every group."""
        return min(side.extra_cached_tokens(rid) for side in self.sides)

    def loaded_groups(self) -> tuple[int, ...]:
        """The groups a load restores: every group (a hit is one every group serves)."""
        return tuple(range(len(self.sides)))

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        for side, ids in zip(self.sides, block_ids, strict=True):
            side.update_state_after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, out: SchedulerOutput) -> GroupedMetadata:
        """Every group's instructions. vLLM's groups share one block pool and alias the same memory: a
        block freed from one group's window may go to any group, so a sliding-window group's saves are
        fenced against the blocks handed out in every group."""
        metas = [side.build_connector_meta(out) for side in self.sides]
        handed_out = tuple(sorted({block for side in self.sides for block in side.allocated_now}))
        return GroupedMetadata(
            tuple(
                attrs.evolve(meta, reused=handed_out) if side.windowed else meta
                for side, meta in zip(self.sides, metas, strict=True)
            )
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        metas = meta.groups if isinstance(meta, GroupedWorkerMetadata) else (None,) * len(self.sides)
        for side, group_meta in zip(self.sides, metas, strict=True):
            side.take_output(group_meta, output.finished_recving)

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        ends = [side.request_finished(request, ids) for side, ids in zip(self.sides, block_ids, strict=True)]
        params = [p for _, p in ends if p is not None]
        merged = {key: min(p[key] for p in params) for key in params[0]} if params else None
        return any(delay for delay, _ in ends), merged

    def take_events(self) -> list[KVCacheEvent]:
        return [event for side in self.sides for event in side.take_events()]

    def reset_cache(self) -> bool:
        for side in self.sides:
            side.reset_cache()
        return True

    def stats(self) -> SchedulerStats:
        return merge_stats([side.stats() for side in self.sides])

    def tracked_requests(self) -> frozenset[str]:
        return frozenset().union(*(side.tracked_requests() for side in self.sides))

    def close(self) -> None:
        for side in self.sides:
            side.close()


def merge_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """The groups' stats as one engine's: blocks, chunks, slots and ops summed; requests counted once
    (the most any group counted), hit tokens the least any group loaded; a shared tier's usage as the
    first group reads it."""
    first = stats[0]
    values: dict[str, Any] = {}
    for name in _SUMMED:
        values[name] = sum(getattr(s, name) for s in stats)
    for name in _PER_REQUEST:
        values[name] = max(getattr(s, name) for s in stats)
    values["hit_tokens"] = min(s.hit_tokens for s in stats)  # what every group loaded
    for name in ("tier_found", "tier_stored"):
        values[name] = tuple(sum(counts) for counts in zip(*(getattr(s, name) for s in stats), strict=True))
    pools = [attrs.astuple(s.pool) for s in stats]
    values["pool"] = PoolUsage(*(sum(field) for field in zip(*pools, strict=True)))
    return attrs.evolve(first, **values)
