"""``SchedulerState``: what the scheduler side's jobs share for one engine — its keys, the pool, the remote
index, the requests, the ops decided and in flight, the counters. ``CacheScheduler`` owns one and hands
it to each job's module (``hits``, ``loads``, ``saves``, ``submission``, ``completion``, ``stats``); none
of them keeps state of its own."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.config.model import KVCoreConfig
from kvcore.ids import ChunkKey, RequestId
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import LayoutKind
from kvcore.model.step import BlockOp
from kvcore.pool.admission import Sightings
from kvcore.pool.block_pool import BlockPool, PoolEvent
from kvcore.pool.eviction import make_policy
from kvcore.pool.pool_index import PoolIndex
from kvcore.pool.write_back import WriteBack
from kvcore.ports import ChunkIndex
from kvcore.scheduling.ledger import OpLedger
from kvcore.scheduling.lifecycle import RequestTable
from kvcore.scheduling.remote_lookup import PrefixLookup
from kvcore.scheduling.request_keys import Keyer
from kvcore.scheduling.requests import RequestState

__all__ = ["COUNTERS", "Resaves", "SchedulerState"]

COUNTERS = (
    "lookups",
    "hit_tokens",
    "loaded_blocks",
    "async_loads",
    "saved_blocks",
    "failed_load_blocks",
    "failed_save_chunks",
    "save_retries",
    "written_back_chunks",
    "failed_write_back_chunks",
    "assembled_chunks",
)
"""The counters since start that ``SchedulerStats`` reports."""


class Resaves:
    """What one request's saves did to its chunks since its first failed save: a failed chunk is saved
    again by the request's next save (a retry), so that it counts once in ``failed_save_chunks`` however
    often it fails, and its retries apart (``save_retries``).

    ``failed``: chunks whose save failed and that no save stored since. ``stored``: without a pool, the
    chunks its saves stored since (a retry sends again every chunk after the first failed one, which the
    remote tier already holds: they count once in ``saved_blocks`` and ``tier_stored``); with a pool,
    a retry sends only what the pool lacks, and this stays empty. Forgotten with its request
    (``SchedulerState.forget``), so that a later request of the same id starts afresh."""

    __slots__ = ("failed", "stored")

    def __init__(self) -> None:
        self.failed: set[ChunkKey] = set()
        self.stored: set[ChunkKey] = set()


class SchedulerState:
    """The shared state of one engine's scheduler side (module docstring). Arguments as
    ``CacheScheduler``'s, checked there."""

    def __init__(
        self,
        config: KVCoreConfig,
        engine: EngineSpec,
        num_slots: int,
        world_size: int,
        hash_identity: str | None,
        remote: ChunkIndex | None,
        write_back: bool,
        per_head: Sequence[bool] = (),
        threaded_lookups: bool = True,
    ) -> None:
        self.config = config
        self.engine = engine
        self.world_size = world_size
        self.block_tokens = engine.layout.block_tokens
        self.blocks_per_chunk = engine.blocks_per_chunk(config.chunk_tokens)
        self.states = engine.layout.kind is LayoutKind.STATE
        self.keyer = Keyer(
            config,
            engine,
            hash_identity=hash_identity,
            shard_keys=remote is not None,
            head_keys=any(per_head),
        )
        self.no_pool = num_slots == 0  # no local tier: the remote tier moves every block itself
        # a policy of one slot for a pool of none: it never sees a key, and ARC wants a capacity
        self.pool = BlockPool(num_slots, make_policy(config.eviction, max(num_slots, 1)))
        self.pool_index = PoolIndex(self.pool)
        self.remote = (
            PrefixLookup(remote, config.lookup_timeout_s, threaded=threaded_lookups)
            if remote is not None
            else None
        )
        self.remote_index = remote
        # one tier behind the pool, which keeps a value per KV head: lookups ask each head's key (a
        # stack's ``CascadeIndex`` asks each of its tiers as it keeps values)
        self.remote_per_head = tuple(per_head) == (True,)
        # every tier behind the pool keeps a value per KV head: a fetched chunk is assembled from them
        self.assembles = bool(per_head) and all(per_head)
        # a sliding-window engine's pool alone looks up the hit's last window only; with a remote tier,
        # whose index answers leading chunks, the lookup is a prefix lookup (a hit as long or shorter)
        self.windowed = engine.window_tokens is not None and remote is None
        self.write_back = WriteBack(self.pool) if write_back and num_slots and remote is not None else None
        self.sightings = Sightings(config.save_after_sightings, num_slots)
        self.table = RequestTable()
        self.requests: dict[RequestId, RequestState] = {}
        self.ops = OpLedger(world_size)
        self.plan: list[BlockOp] = []  # the ops decided since the last plan was taken
        self.plans = 0  # plans taken so far
        self.fenced: list[int] = []  # ops of preempted requests, for the next plan
        self.ended: list[RequestId] = []  # with a remote tier: requests whose sessions may end
        self.finished: list[RequestId] = []  # requests whose delayed free is over
        self.resets = 0
        self.remote_found = 0  # chunks the remote index found beyond the pool (one tier's count)
        self.tier_events: list[PoolEvent] = []
        self.tier_stored: dict[int, int] = {}  # remote tier (0: the first) -> chunks it stored
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.resaves: dict[RequestId, Resaves] = {}  # requests with a failed save, until forgotten

    def forget(self, request_id: RequestId) -> None:
        """Drop what the scheduler side knows of a request that ended and has no op in flight."""
        self.requests.pop(request_id, None)
        self.resaves.pop(request_id, None)

    def release_held(self, req: RequestState) -> None:
        """Release the read locks the request's remote lookup holds, if any."""
        held, req.held = req.held, None
        if held is not None and self.remote is not None:
            self.remote.release_held(held)

    def abandon(self, req: RequestState) -> None:
        """Drop the request's remote lookup in flight and release the locks its hit holds."""
        if self.remote is not None and req.pending is not None:
            self.remote.abandon(req.pending)
        self.release_held(req)
