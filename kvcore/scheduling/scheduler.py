"""The scheduler side of kvcore for any engine: ``CacheScheduler``, its façade.

It decides everything and touches no KV byte: it keys a request's chunks (``kvcore.keying``), finds how
many leading chunks the tiers hold (``hits``), turns that into a ``LoadSpec`` (whole blocks, up to the
prompt's last token), plans loads (``loads``: pins the pool's chunks, reserves slots for fetches) and
saves (``saves``: reserves slots for what is worth saving), and hands the copies to the workers as
``BlockOp``s in a ``StepPlan`` (``submission``). Worker reports come back through ``complete``
(``completion``); only then are pins released and stores published, because a copy in flight may still
read or write a slot. Failures never raise into the engine: a failed load is a list of blocks to
recompute, a failed save a dropped slot.

Each public method is the engine-facing contract of one event (lookup, load, save, step, end, preempt,
reset), documented here where an engine author reads it; its body is its job's module's, over the state
every job shares (``state``).

Typical use, one step of an engine::

    hits = sched.lookup(rid, tokens=prompt, local_tokens=local)   # tokens loadable beyond `local`
    sched.start_load(rid, block_ids)                              # after the engine allocated blocks
    sched.save(rid, block_ids, num_tokens=computed)               # blocks whose KV is now computed
    worker.execute(sched.take_plan())
    sched.complete(worker.reports())
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcore.checks import is_int_in
from kvcore.config.model import KVCoreConfig
from kvcore.errors import ConfigError, InvalidSpecError, UnsupportedConfiguration
from kvcore.ids import RequestId
from kvcore.keying.hashing import NO_EXTRA, ExtraKeys
from kvcore.keying.keys import Keyspace
from kvcore.kit.closing import close_quietly
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import LayoutKind
from kvcore.model.step import WRITE_BACK_SESSION, OpReport, StepPlan
from kvcore.pool.block_pool import BlockPool, PoolEvent
from kvcore.ports import ChunkIndex
from kvcore.scheduling import completion, hits, loads, saves
from kvcore.scheduling.lifecycle import Phase
from kvcore.scheduling.request_keys import Keyer
from kvcore.scheduling.state import SchedulerState
from kvcore.scheduling.stats import SchedulerStats, stats

__all__ = ["CacheScheduler", "SchedulerStats"]


class CacheScheduler:
    """Scheduler side over a host-slot pool, optionally in front of a remote tier: one per engine.

    Alone, the pool is the CPU tier. With ``remote`` (the index of a shared store such as Mooncake), the
    pool is the local tier in front of it: lookups ask the pool first and the remote index for the rest;
    a chunk only the remote tier holds is fetched into a free slot and then loaded (staying in the pool
    for later hits); every save also publishes each rank's shard to the remote tier.

    With ``remote`` and no slots (``num_slots=0``), there is no local tier: every load and save is one
    job of the remote tier, which moves the engine's blocks straight to and from its own memory (an
    LMCache server's shared-memory slots, ``SupportsBlockTransfer``). The remote tier then also dedups
    saves; the scheduler only skips chunks its lookup found there.
    """

    def __init__(
        self,
        config: KVCoreConfig,
        engine: EngineSpec,
        num_slots: int,
        *,
        world_size: int | None = None,
        hash_identity: str | None = None,
        remote: ChunkIndex | None = None,
        write_back: bool = False,
        per_head: Sequence[bool] = (),
        threaded_lookups: bool = True,
    ) -> None:
        """``hash_identity`` names the chain of engine-provided block hashes (e.g. vLLM's algorithm and
        seed) when lookups pass ``block_hashes``; it replaces kvcore's own seed digest in the namespace,
        so that engines whose chains differ can never share keys. ``remote`` is a shared tier's index,
        keyed by each rank's shard; ``per_head[i]``: remote tier ``i`` keeps a value per KV head (a rank's
        key is then its heads' keys joined, ``kvcore.keying.keys.HeadKeyspaces``, and the lookups of that
        tier ask each head's, ``lookup_keys``); ``write_back``: a tier behind the pool is written back
        (``kvcore.pool.write_back``), which ``kvcore.plugins.compose`` reads from the config's stack.
        ``threaded_lookups``: remote lookups advance on a thread of their own (``LookupPump``); false:
        only when asked again, so that what a lookup answers depends on the engine's steps alone (the
        lifecycle fuzzer replays a seed exactly however busy the machine). ``world_size`` (the ranks whose
        reports complete an op) is the engine's ``tp_size``; giving another value is refused."""
        if not isinstance(engine, EngineSpec):
            raise InvalidSpecError(f"engine: got {engine!r}, expected an EngineSpec")
        if world_size is None:
            world_size = engine.tp_size
        if not is_int_in(world_size, 1) or world_size != engine.tp_size:
            raise InvalidSpecError(
                f"world_size: got {world_size!r}, expected the engine's tensor-parallel size {engine.tp_size}"
            )
        if not is_int_in(num_slots, 0):
            raise ConfigError("num_slots", num_slots, "an integer >= 0")
        if num_slots == 0 and remote is None:
            raise ConfigError("num_slots", num_slots, "at least 1 without a remote tier")
        if engine.layout.kind is LayoutKind.STATE and remote is not None:
            raise UnsupportedConfiguration(
                "a recurrent model's state (Mamba layers) is served from the local pool alone: a remote "
                "tier's index answers leading chunks, and a state is kept only at some chunks' ends; "
                "configure a backend without remote tiers"
            )
        self._state = SchedulerState(
            config,
            engine,
            num_slots,
            world_size,
            hash_identity,
            remote,
            write_back,
            per_head,
            threaded_lookups,
        )

    @property
    def config(self) -> KVCoreConfig:
        return self._state.config

    @property
    def engine(self) -> EngineSpec:
        return self._state.engine

    @property
    def blocks_per_chunk(self) -> int:
        return self._state.blocks_per_chunk

    @property
    def keyer(self) -> Keyer:
        """How this engine's requests are keyed."""
        return self._state.keyer

    @property
    def keyspace(self) -> Keyspace:
        """The local pool's keyspace (its namespace changes at a reset with a remote tier)."""
        return self._state.keyer.keyspace

    @property
    def pool(self) -> BlockPool:
        """The local pool's index of chunks and slots."""
        return self._state.pool

    # -- lookups and loads -----------------------------------------------------------------------------

    def lookup(
        self,
        request_id: RequestId,
        *,
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        hash_block_tokens: int | None = None,
        num_tokens: int | None = None,
        local_tokens: int = 0,
        extra: ExtraKeys = NO_EXTRA,
    ) -> int | None:
        """Tokens the tier can load beyond the engine's own ``local_tokens`` hit; ``None``: ask again.

        Give the prompt's ``tokens``, or the engine's chained ``block_hashes`` (of ``hash_block_tokens``
        tokens each) plus ``num_tokens``. ``extra`` (cache salt, LoRA, multimodal items) is folded into the
        keys either way: two salts never share a chunk. The answer is cached per request: asking again
        each step is cheap. Bad input raises ``InvalidSpecError`` before anything is recorded; a request
        that has ended answers 0.
        """
        return hits.lookup(
            self._state, request_id, tokens, block_hashes, hash_block_tokens, num_tokens, local_tokens, extra
        )

    def start_load(
        self, request_id: RequestId, block_ids: Sequence[int | None], *, is_async: bool = False
    ) -> int:
        """Queue the load decided by ``lookup`` into the request's engine blocks; returns tokens queued.

        ``is_async``: the engine runs this load beside its steps (the request waits for it alone, e.g.
        vLLM's ``WAITING_FOR_REMOTE_KVS``); it is counted in ``SchedulerStats.async_loads``.

        ``block_ids`` are the request's blocks from its first token on (``None`` for a block the engine
        does not hold; the load never writes one). The load's leading blocks the engine does not hold are
        blocks it does not need (a sliding-window group keeps only the blocks of its last window): they
        are not loaded, and count as served. Chunks that left the pool since the lookup are not loaded:
        their blocks are reported by ``take_load_errors`` for recompute. Bad block ids (a hole after a
        held block of the load) raise ``InvalidSpecError`` and leave the decided load in place; a request
        that has ended loads nothing.
        """
        return loads.start_load(self._state, request_id, block_ids, is_async)

    def cap_load(self, request_id: RequestId, num_tokens: int) -> int:
        """Lower the load the last ``lookup`` decided to its first ``num_tokens`` tokens; returns the tokens
        it now covers (never more than it did). For an engine whose caches must all serve one hit: a
        hybrid model's KV-cache groups, each a ``CacheScheduler``, serve the least any of them found. With
        a sliding window, it may lower the load further, to a stop whose window the pool holds: call it
        again with the answer until every group agrees. ``num_tokens`` must be an integer >= 0
        (``InvalidSpecError``)."""
        return hits.cap_load(self._state, request_id, num_tokens)

    def load_reads_remote(self, request_id: RequestId) -> bool:
        """Whether the load the last ``lookup`` decided reads a chunk the local pool did not hold then (a
        fetch from the remote tier, or any load of a tier without a local pool): one whose time depends
        on a store or a network, worth running without holding the engine's step (an asynchronous
        load). False when nothing is to be loaded."""
        return hits.load_reads_remote(self._state, request_id)

    def take_lost_blocks(self) -> tuple[int, ...]:
        """Engine block ids the scheduler gave up loading before any copy (their chunks left the pool).

        For engines whose workers report their own failed copies (vLLM): those are already known to
        the engine, so only these must travel to the workers. Clears what ``take_load_errors`` holds.
        """
        return loads.take_lost_blocks(self._state)

    def take_load_errors(self) -> dict[RequestId, tuple[int, ...]]:
        """Engine block ids whose load failed, per request, since the last call: recompute them."""
        return loads.take_load_errors(self._state)

    def extra_cached_tokens(self, request_id: RequestId) -> int:
        """Tokens the tier served beyond the engine's own hit, counting only blocks that really loaded."""
        req = self._state.requests.get(request_id)
        if req is None or req.loaded is None:
            return 0
        return req.loaded.extra_cached_tokens(req.failed_blocks)

    # -- saves -----------------------------------------------------------------------------------------

    def save(
        self,
        request_id: RequestId,
        block_ids: Sequence[int | None],
        num_tokens: int,
        tokens: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        hash_block_tokens: int | None = None,
        *,
        final: bool = False,
    ) -> int:
        """Queue saves of the request's full chunks whose KV is computed; returns chunks queued.

        ``block_ids`` are the request's blocks from its first token on (``None`` for a block the engine
        does not hold: a chunk with such a hole is not saved). ``num_tokens`` counts real computed
        tokens (never placeholders). When the request grew past its prompt (decode tokens are reused by
        the next turn of a chat), ``tokens`` — or the engine's ``block_hashes``, if the lookup used them —
        extend the keys (a chunk is keyed once it is full). Chunks the pool
        already holds are skipped; chunks that do not fit are dropped (no room is not an error). Bad
        input (block ids out of range, repeated or not integers) raises ``InvalidSpecError``.

        With ``partial_chunks: keep``, the whole blocks of the chunk a request stops in are kept too (a
        *tail*, counted as a chunk): once when its prompt is computed, and once more when ``final`` says
        it computes nothing more (call ``save`` with ``final=True`` before ``finish``). Not at every
        decode block: a tail takes a slot, and one is worth it where the next request may diverge. The
        prompt's tail also crosses to a remote tier, as the chain's position after its full chunks,
        unless a whole chunk is keyed there; a tail that does not cross stays in the local pool (with
        none, it is not kept).

        Blocks that this plan's load of the request gave up (their chunk left the pool first) are not
        read, nor any after them: they hold no KV of the request until the engine recomputes them, which
        a later ``save`` stores. An engine whose copies fail in the step that also saves (a synchronous
        load, then the forward pass, then the saves) must not run that request's saves of the step.
        """
        return saves.save(
            self._state, request_id, block_ids, num_tokens, tokens, block_hashes, hash_block_tokens, final
        )

    # -- steps, completions and request ends -------------------------------------------------------------

    def take_plan(self, *, write_back: bool = True) -> StepPlan:
        """The ops decided since the last call, for every worker, and the ops to fence first (see
        ``preempt``). Execute it before the engine reuses any block it freed. With a tier written back,
        it also writes back the pool's least recently used dirty chunks when the pool runs short of
        room (``kvcore.pool.write_back``), unless ``write_back`` is false (a plan the engine waits for)."""
        state = self._state
        if state.write_back is not None and write_back:
            taken = state.write_back.take(state.ops.next_id)
            if taken is not None:
                op, keys = taken
                state.ops.add(WRITE_BACK_SESSION, op, keys, (1,) * len(keys), state.resets)
                state.plan.append(op)
        plan = StepPlan(tuple(state.plan), tuple(state.ended), tuple(state.fenced))
        state.plan, state.ended, state.fenced = [], [], []
        state.plans += 1
        return plan

    def complete(self, reports: Iterable[OpReport]) -> None:
        """Account worker reports; an op is done once every rank reported it (failed if any rank failed)."""
        completion.complete(self._state, reports)

    def finish(self, request_id: RequestId) -> bool:
        """The engine is done with the request. True: saves are in flight, keep its blocks until
        ``take_finished`` names it."""
        return self._end(request_id, Phase.FINISHED)

    def abort(self, request_id: RequestId) -> bool:
        """The request was aborted (maybe before it was ever scheduled); same contract as ``finish``."""
        return self._end(request_id, Phase.ABORTED)

    def preempt(self, request_id: RequestId) -> None:
        """The engine preempted the request and freed its blocks: its cached answer is stale, and the
        request is looked up again when it resumes.

        Every op of the request not yet reported — submitted in earlier steps or in this one — is
        fenced in the next plan (``StepPlan.fenced``): a save that has not copied yet keeps nothing
        and a load writes nothing more, since the freed blocks may already hold another request's KV.
        Block errors not yet taken (``take_load_errors``) name blocks the request no longer owns and are
        dropped: take them before preempting if the engine needs them.
        """
        state = self._state
        req = state.requests.get(request_id)
        tracker = state.table.get(request_id)
        if req is None or tracker is None or tracker.ended:
            return
        state.abandon(req)
        state.fenced.extend(state.ops.fence(request_id))
        req.pending = req.hit_chunks = req.load = req.loaded = None
        req.failed_blocks = set()
        req.saved_chunks = 0  # saved again as it recomputes: the pool skips what it holds
        req.load_errors.clear()  # block ids the request no longer owns
        req.lost_blocks.clear()
        tracker.move(Phase.PREEMPTED)
        tracker.move(Phase.SCHEDULED)

    def take_finished(self) -> tuple[RequestId, ...]:
        """Requests whose delayed free is over since the last call."""
        done, self._state.finished = tuple(self._state.finished), []
        return done

    def reset(self) -> None:
        """Forget every stored chunk, correct with copies in flight (nothing lost, nothing resurrected).

        A remote tier is shared with other engines and is not wiped: this engine moves to a new namespace
        epoch instead, so its old keys become unreachable (to it) and age out of the store. Live requests
        are keyed again under the new epoch and looked up afresh (a lookup in flight is dropped), and a
        load submitted before the reset is reported failed, so no request sees a pre-reset chunk.
        """
        state = self._state
        state.pool.reset()
        if state.write_back is not None:
            state.write_back.clear()
        state.resets += 1
        if state.remote is not None:
            state.keyer.new_epoch(f"reset{state.resets}")
        state.sightings.clear()
        for req in state.requests.values():
            state.abandon(req)
            req.pending = req.hit_chunks = req.tail = req.remote_tail = None
            state.keyer.refresh(req.chain)
            req.saved_chunks = len(req.chain.keys)  # chunks computed before the reset are not saved again
            req.tails_saved = None  # nor the tails of the chunk after them
            req.chain_sent = 0  # the chain is resent under the new keys

    def take_events(self) -> tuple[PoolEvent, ...]:
        """The pool's events since the last call, then the remote tiers' (``PoolEvent.tier``): chunks
        whose every shard a save or write-back stored there. A remote tier's evictions are its own (other
        engines share it, or its server evicts): no event says a chunk left one."""
        state = self._state
        events = state.pool.take_events()
        if state.tier_events:
            events, state.tier_events = (*events, *state.tier_events), []
        return events

    def close(self) -> None:
        """Release the remote index (its threads and connections); the scheduler answers misses after."""
        state = self._state
        if state.remote is not None:
            state.remote.close()
        if state.remote_index is not None:
            close_quietly(state.remote_index)
            state.remote = state.remote_index = None

    def in_flight(self) -> int:
        """Ops decided and not yet reported by every rank."""
        return len(self._state.ops)

    def stats(self) -> SchedulerStats:
        """Counters since start, the pool's usage and each remote tier's."""
        return stats(self._state)

    def tracked_requests(self) -> frozenset[RequestId]:
        """The requests ``stats().requests`` counts: live, or waiting for their copies."""
        return frozenset(self._state.requests)

    def _end(self, request_id: RequestId, phase: Phase) -> bool:
        state = self._state
        req = state.requests.get(request_id)
        if req is not None:
            state.abandon(req)
            req.pending = None
            if state.remote_index is not None:
                state.ended.append(request_id)
        delayed = state.table.end(request_id, phase)
        if not delayed:
            state.forget(request_id)
        return delayed
