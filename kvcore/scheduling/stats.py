"""What the scheduler side reports of itself (``SchedulerStats``): counters since start, the pool's usage,
and for each remote tier what its lookups found, what it stored and how full it is."""

from __future__ import annotations

from attrs import frozen

from kvcore.pool.block_pool import PoolUsage
from kvcore.ports import TierUsage
from kvcore.scheduling.cascade_index import CascadeIndex, tier_usage
from kvcore.scheduling.state import SchedulerState

__all__ = ["SchedulerStats", "stats"]


@frozen
class SchedulerStats:
    """Counters since start (monotonic), and the pool's current usage."""

    lookups: int
    hit_tokens: int
    loaded_blocks: int
    async_loads: int  # loads started asynchronously (``start_load(is_async=True)``)
    saved_blocks: int
    failed_load_blocks: int  # blocks whose load failed, recomputed (a failed load is never retried)
    failed_save_chunks: int  # a request's chunks whose save failed, each once however often retried
    pool: PoolUsage
    requests: int  # live request trackers (0 once every request ended and its copies completed)
    ops_in_flight: int
    tier_found: tuple[int, ...] = ()  # chunks each remote tier's lookups found beyond the pool, in order
    tier_usage: tuple[TierUsage | None, ...] = ()  # how full each remote tier is, where it can tell
    tier_stored: tuple[int, ...] = ()  # chunks each remote tier stored (every shard of them)
    written_back_chunks: int = 0  # pool chunks written back to the tiers written back (``Tier.write``)
    failed_write_back_chunks: int = 0  # of those, chunks that no tier stored
    save_retries: int = 0  # saves of a request's chunk again after its save failed (each retry once)
    # chunks loaded from tiers that keep a value per KV head: each rank assembled its shard from its
    # heads' values, whatever TP size wrote them (a stack counts them where every tier keeps values so)
    assembled_chunks: int = 0


def stats(state: SchedulerState) -> SchedulerStats:
    index = state.remote_index
    if isinstance(index, CascadeIndex):
        found, usage = tuple(index.found), index.usage()
    elif index is not None:
        found, usage = (state.remote_found,), (tier_usage(index),)
    else:
        found, usage = (), ()
    return SchedulerStats(
        **state.counters,
        pool=state.pool.usage(),
        requests=len(state.requests),
        ops_in_flight=len(state.ops),
        tier_found=found,
        tier_usage=usage,
        tier_stored=tuple(state.tier_stored.get(t, 0) for t in range(len(found))),
    )
