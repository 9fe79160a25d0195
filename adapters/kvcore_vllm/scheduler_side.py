"""The connector's scheduler side (vLLM's engine-core process): vLLM's hooks translated to the core.

Chunk keys come from ``request.block_hashes`` (nothing is re-hashed); lookups, load specs, slot bookkeeping
and the step's copies are ``kvcore.scheduling.scheduler.CacheScheduler``'s. This module only keeps what vLLM
does not hand back each step: each request's block table and the live ``Request`` objects, and for the two
things vLLM-specific around the core, the names of chunks in vLLM's hashes (KV events) and, under the lazy
store policy, what freed blocks hold (``EvictionWatch``).

A load is synchronous or asynchronous per ``load_mode`` (``settings.LoadMode``). An asynchronous one is
started like any other (``update_state_after_alloc``) and named in the step's ``receiving``; the request
waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` until every rank reported it done (``finished_recving``), and
until then vLLM, not kvcore, keeps its blocks should it end.

Lazy saves reuse the core's request API: each evicted chain is looked up, saved and finished under a
request id of its own (``kvcore-evicted-N``), so the core's slot bookkeeping, reports and failure
handling are the same as for any request.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvcore.errors import UnsupportedConfiguration
from kvcore.ids import RequestId
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import LayoutKind
from kvcore.model.step import StepPlan
from kvcore.plugins.compose import open_scheduler
from kvcore.scheduling.scheduler import SchedulerStats
from kvcore_vllm.events import ChunkNames
from kvcore_vllm.evictions import EvictedChain, EvictionWatch
from kvcore_vllm.metadata import KVCoreMetadata, KVCoreWorkerMetadata
from kvcore_vllm.settings import LoadMode, StorePolicy, VLLMSettings

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["EVICTED_PREFIX", "EXTRA_CACHED_KEYS", "NULL_BLOCK", "SchedulerSide", "held_blocks"]

log = logging.getLogger(__name__)

EVICTED_PREFIX = "kvcore-evicted-"  # request ids of lazy saves

# kv_transfer_params keys a request sets to get the tokens served from kvcore back (the second for
# drop-in compatibility with LMCache's connector).
EXTRA_CACHED_KEYS = ("num_extra_cached_tokens", "num_lmcache_extra_cached_tokens")

NULL_BLOCK = 0
"""vLLM's null block: what a block table holds where its group keeps no block (a sliding window's blocks
before the window, given back). vLLM's ``BlockPool`` takes it first from its free blocks: id 0."""


def held_blocks(block_ids: Sequence[int]) -> list[int | None]:
    """A vLLM block table as the core takes it: ``None`` where vLLM holds no block (its null block)."""
    return [None if block == NULL_BLOCK else block for block in block_ids]


class SchedulerSide:
    """The scheduler side of one KV-cache group (``group``: its index in vLLM's block tables; a
    sliding-window group has a ``window``: vLLM frees its blocks outside the window while the request
    runs, and the workers fence saves of blocks handed out again). ``failures_by_request``: a load that
    fails is told to vLLM by its request (``failed_recving``), not by its blocks, which vLLM cannot map
    back to requests when a model has several groups; every load is then asynchronous."""

    def __init__(
        self,
        settings: VLLMSettings,
        engine: EngineSpec,
        hash_block_tokens: int,
        hash_identity: str,
        *,
        group: int = 0,
        window: int | None = None,
        failures_by_request: bool = False,
    ) -> None:
        config = settings.core
        self.core = open_scheduler(config, engine, hash_identity=hash_identity)
        self._group = group
        self._window = window
        self._states = engine.layout.kind is LayoutKind.STATE
        self._by_request = failures_by_request
        self.allocated_now: tuple[int, ...] = ()  # blocks of this group handed out in the last step
        self._allocated_async: list[int] = []  # handed to requests whose load runs beside the steps
        self._failed_now: list[str] = []  # (by request) loads that failed before any copy, for the workers
        self.lazy = settings.store_policy is StorePolicy.LAZY
        if self.lazy and hash_block_tokens != engine.layout.block_tokens:
            raise UnsupportedConfiguration(
                f"store_policy 'lazy' needs vLLM's hash block size ({hash_block_tokens}) equal to its "
                f"block size ({engine.layout.block_tokens})"
            )
        self._hash_block_tokens = hash_block_tokens
        self._chunk_tokens = config.chunk_tokens
        self._blocks_per_chunk = config.chunk_tokens // engine.layout.block_tokens
        self._requests: dict[str, Request] = {}
        self._blocks: dict[str, list[int]] = {}
        self._delayed: list[str] = []
        self._named: dict[str, int] = {}  # chunks of each request named for KV events
        capacity = self.core.stats().pool.capacity
        self._names = ChunkNames(
            self.core.keyspace, config.chunk_tokens, hash_block_tokens, 2 * capacity, group
        )
        self.evictions = EvictionWatch()
        self._eviction_ids = itertools.count(1)
        self._unbound_warned = False
        self._load_mode = settings.load_mode
        self._async: set[str] = set()  # answered with an asynchronous load, not yet allocated
        self._receiving: dict[str, tuple[int, ...]] = {}  # async loads not yet reported done: their blocks
        self._stale: list[int] = []  # blocks of async loads that a reset made stale, for the workers
        self._receiving_now: list[str] = []  # asynchronous loads started in this step
        # named received by the workers, not scheduled since: looked up again, their load failed whole
        self._received: set[str] = set()
        self.halted_ranks: set[int] = set()  # ranks whose copies are halted (``BlockWorker.halt``)

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        if self.lazy:
            self.evictions.bind(pool)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = RequestId(request.request_id)
        if request.request_id in self._blocks:
            # vLLM asks only for waiting requests: one with a block table was running and has been
            # preempted since (a cache reset preempts and resumes in one step, and names the request as
            # preempted only in that step's output, after this lookup)
            self._preempted(request.request_id)
        self._requests[request.request_id] = request
        if request.request_id in self._received:
            # vLLM asks again only when the load left no valid token (it freed the blocks): the tier
            # failed this request, whose chunks may still be on their way in; it computes them
            self._received.discard(request.request_id)
            return 0, False
        hits = self.core.lookup(
            rid,
            block_hashes=request.block_hashes,
            hash_block_tokens=self._hash_block_tokens,
            num_tokens=request.num_tokens,
            local_tokens=num_computed_tokens,
        )
        mode = self._load_mode
        is_async = bool(hits) and (
            mode is LoadMode.ASYNC or (mode is LoadMode.AUTO and self.core.load_reads_remote(rid))
        )
        self.settle(request.request_id, hits, is_async)
        return hits, is_async

    @property
    def windowed(self) -> bool:
        """Whether this is a sliding-window group (vLLM frees its blocks while its requests run)."""
        return self._window is not None

    def cap(self, rid: str, hits: int) -> int:
        """Lower the load the lookup decided to ``hits`` tokens, or below where this group (a sliding
        window) cannot serve that; returns the tokens it now loads."""
        return self.core.cap_load(RequestId(rid), hits)

    def settle(self, rid: str, hits: int | None, is_async: bool) -> None:
        """The hit vLLM is told, ``hits`` (one every group of a hybrid model serves: ``cap`` agreed on
        it), and whether its load runs asynchronously."""
        if hits is not None:
            self.cap(rid, hits)
        if is_async:
            self._async.add(rid)
        else:
            self._async.discard(rid)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        self._requests[rid] = request
        is_async = rid in self._async
        self._async.discard(rid)
        if is_async:  # not among the step's scheduled requests: its blocks are named here
            self._allocated_async.extend(block_ids)
        if num_external_tokens > 0:
            queued = self.core.start_load(RequestId(rid), held_blocks(block_ids), is_async=is_async)
            if is_async:  # vLLM waits for it to be reported, whatever the load became
                self._receiving[rid] = tuple(b for b in block_ids if b != NULL_BLOCK)
                self._receiving_now.append(rid)
                if self._by_request and queued < num_external_tokens:
                    self._failed_now.append(rid)  # chunks gone since the lookup: recomputed whole

    def build_connector_meta(self, out: SchedulerOutput) -> KVCoreMetadata:
        # workers report their own failed copies in the step that detects them; only the blocks the
        # scheduler gave up on before any copy travel to them, taken before a preemption drops them
        lost = self.core.take_lost_blocks() + tuple(self._stale)
        self._stale.clear()
        if self._by_request:  # told by request (``_failed_now``), never by block
            lost = ()
        for rid in out.preempted_req_ids or ():  # before the scheduled: preempted and resumed at once
            if rid in self._blocks:
                self._preempted(rid)
        group = self._group
        allocated: list[int] = []  # every block handed to a scheduled request in this step
        for new in out.scheduled_new_reqs:
            self._received.discard(new.req_id)
            self._blocks[new.req_id] = self._current(out, new.req_id, list(new.block_ids[group]))
            allocated.extend(new.block_ids[group])
            self._save(new.req_id, new.num_computed_tokens + out.num_scheduled_tokens.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                allocated.extend(new_ids[group])
            if rid in cached.resumed_req_ids:
                self._blocks[rid] = list(new_ids[group]) if new_ids is not None else []
            elif new_ids is not None:
                self._blocks.setdefault(rid, []).extend(new_ids[group])
            if self.windowed:
                self._blocks[rid] = self._current(out, rid, self._blocks.get(rid, []))
            self._save(rid, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(rid, 0))
        plan = self.core.take_plan()
        evictions = self._save_evicted(allocated) if self.lazy else StepPlan(())
        self.allocated_now = tuple(b for b in (*allocated, *self._allocated_async) if b != NULL_BLOCK)
        self._allocated_async.clear()
        reused = self.allocated_now if self.windowed else ()
        meta = KVCoreMetadata(
            plan,
            tuple(self._delayed),
            lost,
            evictions,
            tuple(self._receiving_now),
            reused=reused,
            failed_requests=tuple(self._failed_now),
        )
        self._failed_now.clear()
        self._delayed.clear()
        self._receiving_now.clear()
        return meta

    def _current(self, out: SchedulerOutput, rid: str, mirrored: list[int]) -> list[int]:
        """A sliding-window group: the request's block table as vLLM holds it now, where vLLM offers it
        (its blocks outside the window are then the null block); else the table kept from the steps'
        allocations (``mirrored``), which is vLLM's own for a group whose blocks stay until the end."""
        if not self.windowed:
            return mirrored
        state = getattr(out, "kv_connector_block_state", None)
        current = state.get_block_ids(rid) if state is not None else None
        return list(current[self._group]) if current is not None else list(mirrored)

    def _preempted(self, rid: str) -> None:
        """The request was preempted and its blocks freed: the core fences its copies in flight (in the
        next plan), and its block table starts again when it resumes."""
        self.core.preempt(RequestId(rid))
        request, blocks = self._requests.get(rid), self._blocks.pop(rid, None)
        if request is not None and blocks is not None:
            self.evictions.freed(request.block_hashes, blocks)

    def _save(self, rid: str, computed_tokens: int, *, final: bool = False) -> None:
        request = self._requests.get(rid)
        blocks = self._blocks.get(rid)
        if self.lazy or request is None or not blocks:
            return
        # KV is computed for positions below computed_tokens; only those whose token ids are known (and
        # hashed) can be keyed: num_tokens counts them, never the async scheduler's placeholders
        real = min(computed_tokens, request.num_tokens)
        named = self._named.get(rid, 0)
        self._named[rid] = self._names.name(request.block_hashes, named, real // self._chunk_tokens)
        table = held_blocks(blocks)
        if self._states:
            table = _state_at(table, real, self._chunk_tokens)
        self.core.save(
            RequestId(rid),
            table,
            num_tokens=real,
            block_hashes=request.block_hashes,
            hash_block_tokens=self._hash_block_tokens,
            final=final,
        )

    def _save_evicted(self, allocated: list[int]) -> StepPlan:
        """Saves of the chunks vLLM evicted in this step, for the workers to run before the forward pass."""
        if not self.evictions.bound:
            if not self._unbound_warned:
                self._unbound_warned = True
                log.warning(
                    "kvcore: vLLM bound no block pool to the connector; store_policy 'lazy' saves nothing"
                )
            return StepPlan(())
        for chain in self.evictions.evicted(allocated):
            self._save_chain(chain)
        return self.core.take_plan(write_back=False)  # the workers wait for it: no write-back in it

    def _save_chain(self, chain: EvictedChain) -> None:
        per, chunk = self._blocks_per_chunk, self._chunk_tokens
        full = len(chain.hashes) // per
        if not full:
            return
        rid = RequestId(f"{EVICTED_PREFIX}{next(self._eviction_ids)}")
        hashes = chain.hashes[: full * per]
        # one token past the chain, so that the answer can cover all of it (a load never covers a whole
        # prompt); it counts the leading chunks the tiers hold already. A remote tier answers later
        # (``None``): then the save starts after the leading chunks vLLM no longer holds (saved when they
        # were evicted), and the pool or the remote tier drops what it holds already.
        held = self.core.lookup(
            rid,
            block_hashes=hashes,
            hash_block_tokens=self._hash_block_tokens,
            num_tokens=full * chunk + 1,
        )
        if held is None:
            start = 0
            while start < full and None in chain.block_ids[start * per : (start + 1) * per]:
                start += 1
        else:
            start = held // chunk
        stop = start
        while stop < full and None not in chain.block_ids[stop * per : (stop + 1) * per]:
            stop += 1
        if stop > start:
            self._names.name(hashes, start, stop)
            self.core.save(rid, chain.block_ids[: stop * per], num_tokens=stop * chunk)
        self.core.finish(rid)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.take_output(output.kv_connector_worker_meta, output.finished_recving)

    def take_output(self, meta: object, finished_recving: Iterable[str] | None) -> None:
        """The workers' reports of the step (``KVCoreWorkerMetadata``) and the requests whose
        asynchronous loads every worker reported done."""
        if isinstance(meta, KVCoreWorkerMetadata):
            self.core.complete(meta.reports)
            for rank in set(meta.halted_ranks) - self.halted_ranks:
                log.error(
                    "kvcore: rank %d halted its copies after a copy into vLLM's blocks hung; its loads "
                    "and saves fail (cache misses) until that copy ends",
                    rank,
                )
                self.halted_ranks.add(rank)
            for rank in set(meta.resumed_ranks) & self.halted_ranks:
                log.warning("kvcore: rank %d copies again", rank)
                self.halted_ranks.discard(rank)
        received = set(finished_recving or ()) & self._receiving.keys()
        for rid in received:
            del self._receiving[rid]
        self._received |= {rid for rid in received if rid in self._requests}  # not those ended since
        self.core.take_finished()  # retirements are vLLM's to report (finished_sending); drop ours

    def extra_cached_tokens(self, rid: str) -> int:
        """The request's prompt tokens the tiers served (its loaded hit, less what failed)."""
        return self.core.extra_cached_tokens(RequestId(rid))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = RequestId(request.request_id)
        params = None
        asked = request.kv_transfer_params or {}
        wanted = [k for k in EXTRA_CACHED_KEYS if k in asked]
        if wanted:
            params = dict.fromkeys(wanted, self.extra_cached_tokens(rid))
        if self.core.keyer.tails and request.request_id not in self._receiving:
            if request.request_id in self._blocks:
                self._blocks[request.request_id] = list(block_ids)  # as vLLM holds them now
            self._save(request.request_id, request.num_computed_tokens, final=True)  # its last tail
        # a request that ends while its asynchronous load runs: vLLM keeps its blocks until the workers
        # report the load (finished_recving) and frees them then; a second report would free them twice
        delay = self.core.finish(rid) and request.request_id not in self._receiving
        self._async.discard(request.request_id)
        self._received.discard(request.request_id)
        if delay:
            self._delayed.append(request.request_id)
        self._requests.pop(request.request_id, None)
        self._blocks.pop(request.request_id, None)
        self._named.pop(request.request_id, None)
        self.evictions.freed(request.block_hashes, block_ids)
        return delay, params

    def take_events(self) -> list[KVCacheEvent]:
        return self._names.events(self.core.take_events())

    def reset_cache(self) -> bool:
        """Forget every stored chunk. An asynchronous load still running may be copying pre-reset KV:
        its request's blocks are reported failed (recomputed) with the next step's lost blocks, which the
        workers name no later than the request itself."""
        self.core.reset()
        self.evictions.clear()
        for blocks in self._receiving.values():
            self._stale.extend(blocks)
        if self._by_request:
            self._failed_now.extend(self._receiving)
        return True

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def tracked_requests(self) -> frozenset[str]:
        return self.core.tracked_requests()

    def close(self) -> None:
        self.core.close()


def _state_at(table: list[int | None], computed: int, chunk_tokens: int) -> list[int | None]:
    """A Mamba group's table with only the block whose state is the one after ``computed`` tokens: the
    block ending there, where ``computed`` is a block end (vLLM's prefill steps end on block ends, and its
    decode steps reach them); no block otherwise. A state block of an earlier block end may still be in
    vLLM's table, and holds that state, but it is saved in the step that reached it, never later: a
    block whose request computed past its end from inside it holds the state where the step started."""
    last = computed // chunk_tokens - 1
    if computed % chunk_tokens or not 0 <= last < len(table):
        return [None] * len(table)
    return [block if n == last else None for n, block in enumerate(table)]
