"""The scheduler side of kvcore for any engine: lookups, load specs, slot bookkeeping and the step's ops.

It decides everything and touches no KV byte: it keys a request's chunks (``request_keys``), asks the
index how many leading chunks it holds, turns that into a ``LoadSpec`` (whole blocks, up to the prompt's
last token), pins slots for loads and reserves slots for saves in the ``BlockPool`` (what is worth
saving: ``admission``), and hands the copies to the workers as ``BlockOp``s in a ``StepPlan``. Worker
reports come back through ``complete`` (the ops in flight: ``ledger``); only then are pins released and
stores published, because a copy in flight may still read or write a slot. Failures never raise into the
engine: a failed load is a list of blocks to recompute, a failed save a dropped slot.

This module is the façade: each public method is the engine-facing contract of one event (lookup, load,
save, step, end, preempt, reset) in one place, composed of the modules named above; it is longer than the
others because those contracts are documented here, where an engine author reads them.

Typical use, one step of an engine::

    hits = sched.lookup(rid, tokens=prompt, local_tokens=local)   # tokens loadable beyond `local`
    sched.start_load(rid, block_ids)                              # after the engine allocated blocks
    sched.save(rid, block_ids, num_tokens=computed)               # blocks whose KV is now computed
    worker.execute(sched.take_plan())
    sched.complete(worker.reports())
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import cast

import attrs
from attrs import frozen

from kvcore.checks import check_block_table, is_int_in
from kvcore.config.model import KVCoreConfig
from kvcore.config.tiers import TierStack
from kvcore.errors import ConfigError, InvalidSpecError, UnsupportedConfiguration
from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.keying.hashing import NO_EXTRA, ExtraKeys
from kvcore.keying.keys import Keyspace
from kvcore.keying.request_keys import ChunkChain, Keyer, prompt_tokens, token_sequence
from kvcore.kit.closing import close_quietly
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import LayoutKind
from kvcore.model.step import WRITE_BACK_SESSION, BlockOp, OpReport, StepPlan
from kvcore.pool.admission import Sightings
from kvcore.pool.block_pool import BlockPool, PoolEvent, PoolEventKind, PoolUsage
from kvcore.pool.eviction import make_policy
from kvcore.pool.pool_index import PoolIndex
from kvcore.pool.write_back import WriteBack
from kvcore.ports import ChunkIndex, Direction, HeldChunks, TierUsage
from kvcore.scheduling.cascade_index import CascadeIndex, tier_usage
from kvcore.scheduling.ledger import InFlightOp, OpLedger
from kvcore.scheduling.lifecycle import JobRole, Phase, RequestTable, RequestTracker
from kvcore.scheduling.load_spec import ChunkPiece, LoadSpec, check_local_tokens, hit_tokens, plan_load
from kvcore.scheduling.op_draft import OpDraft
from kvcore.scheduling.remote_lookup import PendingLookup, PrefixLookup

__all__ = ["CacheScheduler", "SchedulerStats"]

log = logging.getLogger(__name__)


@frozen
class SchedulerStats:
    """Counters since start (monotonic), and the pool's current usage."""

    lookups: int
    hit_tokens: int
    loaded_blocks: int
    async_loads: int  # loads started asynchronously (``start_load(is_async=True)``)
    saved_blocks: int
    failed_load_blocks: int
    failed_save_chunks: int
    pool: PoolUsage
    requests: int  # live request trackers (0 once every request ended and its copies completed)
    ops_in_flight: int
    tier_found: tuple[int, ...] = ()  # chunks each remote tier's lookups found beyond the pool, in order
    tier_usage: tuple[TierUsage | None, ...] = ()  # how full each remote tier is, where it can tell
    tier_stored: tuple[int, ...] = ()  # chunks each remote tier stored (every shard of them)
    written_back_chunks: int = 0  # pool chunks written back to the tiers written back (``Tier.write``)
    failed_write_back_chunks: int = 0  # of those, chunks that no tier stored


class _Request:
    """Scheduler-side facts about one request, beside its lifecycle tracker."""

    __slots__ = (
        "answer",
        "chain",
        "chain_sent",
        "failed_blocks",
        "held",
        "load",
        "load_errors",
        "load_from",
        "loaded",
        "local_hits",
        "lost_blocks",
        "pending",
        "prompt_tokens",
        "remote_tail",
        "saved_chunks",
        "tail",
        "tails_saved",
        "unloaded",
    )

    def __init__(self, chain: ChunkChain, prompt_tokens: int) -> None:
        self.chain = chain
        self.prompt_tokens = prompt_tokens
        self.pending: PendingLookup | None = None  # a remote lookup in flight
        self.held: HeldChunks | None = None  # the remote lookup's locks, until the load hands them over
        self.local_hits = 0  # leading chunks the local pool held when looked up
        self.answer: int | None = None  # leading chunks the tiers hold
        self.load: LoadSpec | None = None
        self.loaded: LoadSpec | None = None  # the load started, kept for extra_cached_tokens
        self.load_from = 0  # request block index of its first block written (after blocks not held)
        self.failed_blocks: set[int] = set()  # request block indices whose load failed
        self.load_errors: list[int] = []  # engine block ids to recompute, any cause
        self.lost_blocks: list[int] = []  # the part the scheduler itself decided (chunk gone before the copy)
        self.saved_chunks = 0
        self.chain_sent = 0  # leading chain positions (``chain.rank_keys``) already sent to the workers
        self.tail: _Tail | None = None  # the tail of the chunk after the answer's chunks that a tier holds
        # the prompt's tail, asked of the remote tier after the chain (while pending), or found there
        self.remote_tail: _Tail | None = None
        self.tails_saved: set[tuple[int, int]] | None = set()  # (chunk, blocks); None: save no more
        # (plan, block): this plan's load gave up its blocks from ``block`` on before any copy
        self.unloaded: tuple[int, int] | None = None

    def stop_answer_at(self, chunk: int) -> None:
        """A chunk of the load is gone or failed: asked again (an engine that gave the request's blocks
        back), the lookup stops before it, so the same load is not tried again."""
        if self.answer is not None:
            self.answer = min(self.answer, chunk)
        if self.tail is not None and chunk <= self.tail.chunk:
            self.tail = None


@frozen
class _Tail:
    """The first ``blocks`` blocks of request chunk ``chunk``, under ``key`` in the pool and under
    ``rank_keys`` (one per rank) in a remote tier, where it is the chain's next position after its full
    chunks. ``remote``: found in the remote tier, not in the pool."""

    chunk: int
    key: ChunkKey
    blocks: int
    rank_keys: tuple[ChunkKey, ...] = ()
    remote: bool = False


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
    ) -> None:
        """``hash_identity`` names the chain of engine-provided block hashes (e.g. vLLM's algorithm and
        seed) when lookups pass ``block_hashes``; it replaces kvcore's own seed digest in the namespace,
        so that engines whose chains differ can never share keys. ``remote`` is a shared tier's index,
        keyed by each rank's shard. ``world_size`` (the ranks whose reports complete an op) is the
        engine's ``tp_size``; giving another value is refused."""
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
        self.config = config
        self.engine = engine
        self.world_size = world_size
        self.block_tokens = engine.layout.block_tokens
        self.blocks_per_chunk = engine.blocks_per_chunk(config.chunk_tokens)
        self._states = engine.layout.kind is LayoutKind.STATE
        if self._states and remote is not None:
            raise UnsupportedConfiguration(
                "a recurrent model's state (Mamba layers) is served from the local pool alone: a remote "
                "tier's index answers leading chunks, and a state is kept only at some chunks' ends; "
                "configure a backend without remote tiers"
            )
        self.keyer = Keyer(config, engine, hash_identity=hash_identity, shard_keys=remote is not None)
        self._resets = 0
        self._direct = num_slots == 0  # no local tier: the remote tier moves every block itself
        # a policy of one slot for a pool of none: it never sees a key, and ARC wants a capacity
        self.pool = BlockPool(num_slots, make_policy(config.eviction, max(num_slots, 1)))
        self._index = PoolIndex(self.pool)
        self._remote = PrefixLookup(remote, config.lookup_timeout_s) if remote is not None else None
        self._remote_index = remote
        # a sliding-window engine's pool alone looks up the hit's last window only; with a remote tier,
        # whose index answers leading chunks, the lookup is a prefix lookup (a hit as long or shorter)
        self._windowed = engine.window_tokens is not None and remote is None
        self._remote_found = 0  # chunks the remote index found beyond the pool (one tier's count)
        self._table = RequestTable()
        self._requests: dict[RequestId, _Request] = {}
        self._ops = OpLedger(world_size)
        self._plan: list[BlockOp] = []
        self._plans = 0  # plans taken so far
        self._fenced: list[int] = []  # ops of preempted requests, for the next plan
        self._ended: list[RequestId] = []  # with a remote tier: requests whose sessions may end
        self._finished: list[RequestId] = []
        self._sightings = Sightings(config.save_after_sightings, num_slots)
        self._tier_events: list[PoolEvent] = []
        self._tier_stored: dict[int, int] = {}  # remote tier (0: the first) -> chunks it stored
        stack = config.backend
        written_back = isinstance(stack, TierStack) and stack.writes_back and remote is not None
        self._write_back = WriteBack(self.pool) if written_back and num_slots else None
        self._counters = dict.fromkeys(
            (
                "lookups",
                "hit_tokens",
                "loaded_blocks",
                "async_loads",
                "saved_blocks",
                "failed_load_blocks",
                "failed_save_chunks",
                "written_back_chunks",
                "failed_write_back_chunks",
            ),
            0,
        )

    @property
    def keyspace(self) -> Keyspace:
        """The local pool's keyspace (its namespace changes at a reset with a remote tier)."""
        return self.keyer.keyspace

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
        if tokens is not None and block_hashes is not None:
            raise InvalidSpecError("lookup: give tokens or block_hashes, not both")
        if not isinstance(extra, ExtraKeys):
            raise InvalidSpecError(f"extra: got {extra!r}, expected ExtraKeys")
        total = prompt_tokens(tokens, block_hashes, hash_block_tokens, num_tokens)
        check_local_tokens(total, local_tokens, self.block_tokens)
        req = self._requests.get(request_id)
        if req is None:
            # may raise: nothing is recorded yet
            req = _Request(self.keyer.chain(extra, tokens, block_hashes, hash_block_tokens), total)
            self._requests[request_id] = req
            self._table.track(request_id)
            self._counters["lookups"] += 1
            if self._sightings.active:  # the prompt's tail is admitted by its sightings too
                prompt_tail = self._tail_at(req, total)
                tail_keys = () if prompt_tail is None else (prompt_tail.key,)
                self._sightings.sight((*req.chain.keys, *tail_keys))
        tracker = self._table.get(request_id)
        if tracker is None or tracker.ended:
            return 0
        if req.answer is None:
            req.answer = self._answer(req)
            if req.answer is None:
                return None  # a remote lookup is pending: ask again next step
            req.tail = self._tail_hit(req, req.answer)
            found = req.remote_tail
            if found is not None and (req.tail is None or req.tail.blocks < found.blocks):
                req.tail = attrs.evolve(found, remote=True)
        external = hit_tokens(req.answer, req.chain.counts)
        if req.tail is not None:
            external += req.tail.blocks * self.block_tokens
        req.load = self._fit_window(
            req,
            plan_load(
                prompt_tokens=total,
                local_tokens=local_tokens,
                external_tokens=external,
                block_tokens=self.block_tokens,
            ),
        )
        if req.load is None:
            self._release_held(req)
        return req.load.num_tokens if req.load is not None else 0

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
        table = check_block_table("block_ids", block_ids, self.engine.layout.num_blocks)
        req = self._requests.get(request_id)
        tracker = self._table.get(request_id)
        spec = req.load if req is not None else None
        if req is None or spec is None or tracker is None or tracker.ended:
            if req is not None:
                req.load = None
            return 0
        needed = table[spec.first_block : spec.first_block + spec.num_blocks]
        skipped = next((n for n, block in enumerate(needed) if block is not None), len(needed))
        if len(table) < spec.first_block + spec.num_blocks or None in needed[skipped:]:
            raise InvalidSpecError(
                f"block_ids: request {request_id}: the load writes blocks {spec.first_block} to "
                f"{spec.first_block + spec.num_blocks - 1} of the request, got {len(table)} block ids "
                f"({needed[skipped:].count(None)} of those missing after the first held one)"
            )
        ids = cast(tuple[int, ...], table)  # no hole in the load's range after its skipped blocks
        req.load = None
        spec = attrs.evolve(spec, is_async=is_async)
        req.loaded = spec
        req.failed_blocks = set()  # a new load: what failed in an earlier one no longer counts
        # the blocks written: from the first block the engine holds
        written = attrs.evolve(spec, start=max(spec.start, (spec.first_block + skipped) * self.block_tokens))
        req.load_from = written.first_block
        draft = OpDraft(self.blocks_per_chunk)
        # Which pieces come from the pool and which from the remote tier; the pool's are pinned before
        # any fetch reserves a slot, so that no fetch evicts a chunk this very load needs.
        sources: list[tuple[ChunkPiece, ChunkKey, bool]] = []
        for piece in written.pieces(self.config.chunk_tokens) if skipped < len(needed) else ():
            tail = req.tail if req.tail is not None and req.tail.chunk == piece.chunk else None
            if tail is None and piece.chunk >= len(req.chain.keys):
                break  # the tail this load was decided with failed since: its blocks are recomputed
            key = tail.key if tail is not None else req.chain.keys[piece.chunk]
            if self.pool.lookup((key,)):
                sources.append((piece, key, True))
            elif self._remote is not None and (piece.chunk < (req.answer or 0) or (tail and tail.remote)):
                sources.append((piece, key, False))
            else:
                break  # the chunk left the pool since the lookup
        pinned = [key for _, key, local in sources if local]
        self.pool.pin(pinned)
        why = "left the pool before loading"
        for n, (piece, key, local) in enumerate(sources):
            tail = req.tail if req.tail is not None and req.tail.key == key else None
            slot: int | None = None
            if local:
                slot = self.pool.slots_of((key,))[0]
            elif not self._direct:
                reserved = self.pool.prepare_store((key,)).slots
                if not reserved:  # no free slot, or the chunk is being saved now: recompute from here
                    self.pool.unpin([k for _, k, loc in sources[n:] if loc])
                    why = "not fetched: no pool slot free (all pinned or being stored), or it is being saved"
                    break
                slot = reserved[0][1]
            draft.add(
                key,
                piece.chunk,
                ids,
                slot,
                first_block=piece.first_block,
                num_blocks=piece.num_blocks,
                shard_keys=None if local else tail.rank_keys if tail else req.chain.rank_keys[piece.chunk],
                fetched=not local,
                value_blocks=tail.blocks if tail else None,
            )
        loaded = len(draft.engine_blocks)
        lost = spec.num_blocks - skipped - loaded
        if lost:
            log.warning("kvcore: request %s: %d blocks %s", request_id, lost, why)
            lost_from = written.first_block + loaded
            req.unloaded = (self._plans, lost_from)
            req.stop_answer_at(lost_from // self.blocks_per_chunk)
            req.failed_blocks.update(range(lost_from, spec.first_block + spec.num_blocks))
            req.load_errors.extend(ids[lost_from : spec.first_block + spec.num_blocks])
            req.lost_blocks.extend(ids[lost_from : spec.first_block + spec.num_blocks])
        held, req.held = req.held, None
        if held is not None:
            if self._remote is None:  # closed: the index dropped its locks
                held = None
            elif not draft.fetched:  # the load reads nothing remote: no worker will take the locks
                self._remote.release_held(held)
                held = None
            elif not self._remote.hand_over(held):  # too old to hand over: released
                held = None
        if not loaded and skipped < len(needed):
            return 0
        if loaded:
            self._submit(request_id, Direction.LOAD, draft, held, req.remote_tail)
        queued = spec.tokens_in(skipped + loaded)
        self._counters["hit_tokens"] += queued
        self._counters["async_loads"] += is_async
        return queued

    def cap_load(self, request_id: RequestId, num_tokens: int) -> int:
        """Lower the load the last ``lookup`` decided to its first ``num_tokens`` tokens; returns the tokens
        it now covers (never more than it did). For an engine whose caches must all serve one hit: a
        hybrid model's KV-cache groups, each a ``CacheScheduler``, serve the least any of them found. With
        a sliding window, it may lower the load further, to a stop whose window the pool holds: call it
        again with the answer until every group agrees. ``num_tokens`` must be an integer >= 0
        (``InvalidSpecError``)."""
        if not is_int_in(num_tokens, 0):
            raise InvalidSpecError(f"num_tokens: got {num_tokens!r}, expected an integer >= 0")
        req = self._requests.get(request_id)
        if req is None or req.load is None:
            return 0
        if num_tokens >= req.load.num_tokens:
            return req.load.num_tokens
        capped = attrs.evolve(req.load, stop=req.load.start + num_tokens) if num_tokens else None
        req.load = self._fit_window(req, capped)
        if req.load is None:
            self._release_held(req)
            return 0
        return req.load.num_tokens

    def load_reads_remote(self, request_id: RequestId) -> bool:
        """Whether the load the last ``lookup`` decided reads a chunk the local pool did not hold then (a
        fetch from the remote tier, or any load of a tier without a local pool): one whose time depends
        on a store or a network, worth running without holding the engine's step (an asynchronous
        load). False when nothing is to be loaded."""
        req = self._requests.get(request_id)
        if req is None or req.load is None or self._remote is None:
            return False
        chunk = self.config.chunk_tokens
        first = max(req.load.start // chunk, req.local_hits)
        remote_tail = req.tail is not None and req.tail.remote
        last = min((req.load.stop - 1) // chunk, (req.answer or 0) - 1 + remote_tail)
        return self._direct or last >= first

    def take_lost_blocks(self) -> tuple[int, ...]:
        """Engine block ids the scheduler gave up loading before any copy (their chunks left the pool).

        For engines whose workers report their own failed copies (vLLM): those are already known to
        the engine, so only these must travel to the workers. Clears what ``take_load_errors`` holds.
        """
        lost: list[int] = []
        for req in self._requests.values():
            lost.extend(req.lost_blocks)
            req.lost_blocks.clear()
            req.load_errors.clear()
        return tuple(lost)

    def take_load_errors(self) -> dict[RequestId, tuple[int, ...]]:
        """Engine block ids whose load failed, per request, since the last call: recompute them."""
        out = {}
        for request_id, req in self._requests.items():
            if req.load_errors:
                out[request_id] = tuple(req.load_errors)
                req.load_errors.clear()
                req.lost_blocks.clear()
        return out

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
        table = check_block_table("block_ids", block_ids, self.engine.layout.num_blocks)
        if not is_int_in(num_tokens, 0):
            raise InvalidSpecError(f"num_tokens: got {num_tokens!r}, expected an integer >= 0")
        if tokens is not None:
            token_sequence(tokens)
        req = self._requests.get(request_id)
        tracker = self._table.get(request_id)
        if req is None or tracker is None or tracker.ended:
            return 0
        chain = req.chain
        if (tokens is not None and chain.by_hashes) or (block_hashes is not None and not chain.by_hashes):
            given = "tokens" if tokens is not None else "block_hashes"
            raise InvalidSpecError(
                f"{given}: request {request_id} was looked up by the other kind of key; its keys cannot "
                f"grow from {given}"
            )
        chunk_tokens = self.config.chunk_tokens
        full = num_tokens // chunk_tokens
        if full > chain.full_chunks(chunk_tokens) and (tokens is not None or block_hashes is not None):
            if block_hashes is not None:
                changed = self.keyer.rekey(chain, block_hashes, hash_block_tokens)
            else:
                changed = self.keyer.extend(chain, tokens or ())
            req.chain_sent = min(req.chain_sent, changed)  # the first key not sent yet under its name
        full = min(full, chain.full_chunks(chunk_tokens), len(table) // self.blocks_per_chunk)
        # blocks this plan's load gave up hold no KV of the request yet, nor do the blocks the engine
        # computes after them in this step (their attention read those): saved once recomputed
        unloaded = req.unloaded[1] if req.unloaded is not None and req.unloaded[0] == self._plans else None
        if unloaded is not None:
            full = min(full, unloaded // self.blocks_per_chunk)
            num_tokens = min(num_tokens, unloaded * self.block_tokens)
        # without a local tier, the chunks the remote tier held at lookup are not sent to it again
        start = max(req.saved_chunks, req.answer or 0) if self._direct else req.saved_chunks
        per = self.blocks_per_chunk
        whole = [i for i in range(start, full) if None not in table[i * per : (i + 1) * per]]
        ids = cast(tuple[int, ...], table)  # only whole chunks and tails (no hole) are read below
        wanted = list(self._sightings.admitted([chain.keys[i] for i in whole]))
        tail = self._tail_to_save(req, table, num_tokens, final, tokens, block_hashes, hash_block_tokens)
        # only the prompt's tail crosses: a remote lookup asks for no other
        crosses = (
            tail is not None
            and self._remote is not None
            and tail.chunk == len(chain.keys)
            and (tail.chunk, tail.blocks) == self._tail_span(req.prompt_tokens)
        )
        if tail is not None and (crosses or not self._direct) and self._sightings.admitted([tail.key]):
            wanted.append(tail.key)
        else:
            tail = None
        if full > start:
            req.saved_chunks = full
        if not wanted:
            return 0
        slots: Sequence[tuple[ChunkKey, int | None]] = (
            [(key, None) for key in wanted] if self._direct else self.pool.prepare_store(wanted).slots
        )
        if not slots:
            return 0
        draft = OpDraft(self.blocks_per_chunk)
        writers = self.keyer.writers
        position = {chain.keys[i]: i for i in whole}
        for key, slot in slots:
            this = tail if tail is not None and key == tail.key else None
            chunk = this.chunk if this is not None else position[key]
            owned = None  # a shared tier is written by one rank of each group of replicas
            if self._remote is not None and (this is None or crosses):
                shards = this.rank_keys if this is not None else chain.rank_keys[chunk]
                owned = tuple(k if w else None for k, w in zip(shards, writers, strict=True))
            blocks = this.blocks if this is not None else None
            draft.add(key, chunk, ids, slot, num_blocks=blocks, shard_keys=owned, value_blocks=blocks)
        self._submit(request_id, Direction.SAVE, draft, tail=tail if crosses else None)
        return len(draft.keys)

    # -- steps, completions and request ends -------------------------------------------------------------

    def take_plan(self, *, write_back: bool = True) -> StepPlan:
        """The ops decided since the last call, for every worker, and the ops to fence first (see
        ``preempt``). Execute it before the engine reuses any block it freed. With a tier written back,
        it also writes back the pool's least recently used dirty chunks when the pool runs short of
        room (``kvcore.pool.write_back``), unless ``write_back`` is false (a plan the engine waits for)."""
        if self._write_back is not None and write_back:
            taken = self._write_back.take(self._ops.next_id)
            if taken is not None:
                op, keys = taken
                self._ops.add(WRITE_BACK_SESSION, op, keys, (1,) * len(keys), self._resets)
                self._plan.append(op)
        plan = StepPlan(tuple(self._plan), tuple(self._ended), tuple(self._fenced))
        self._plan, self._ended, self._fenced = [], [], []
        self._plans += 1
        return plan

    def complete(self, reports: Iterable[OpReport]) -> None:
        """Account worker reports; an op is done once every rank reported it (failed if any rank failed)."""
        for report in reports:
            entry = self._ops.report(report)
            if entry is not None:
                self._finish_op(entry)

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
        req = self._requests.get(request_id)
        tracker = self._table.get(request_id)
        if req is None or tracker is None or tracker.ended:
            return
        self._abandon(req)
        self._fenced.extend(self._ops.fence(request_id))
        req.pending = req.answer = req.load = req.loaded = None
        req.failed_blocks = set()
        req.saved_chunks = 0  # saved again as it recomputes: the pool skips what it holds
        req.load_errors.clear()  # block ids the request no longer owns
        req.lost_blocks.clear()
        tracker.move(Phase.PREEMPTED)
        tracker.move(Phase.SCHEDULED)

    def extra_cached_tokens(self, request_id: RequestId) -> int:
        """Tokens the tier served beyond the engine's own hit, counting only blocks that really loaded."""
        req = self._requests.get(request_id)
        if req is None or req.loaded is None:
            return 0
        return req.loaded.extra_cached_tokens(req.failed_blocks)

    def take_finished(self) -> tuple[RequestId, ...]:
        """Requests whose delayed free is over since the last call."""
        done, self._finished = tuple(self._finished), []
        return done

    def reset(self) -> None:
        """Forget every stored chunk, correct with copies in flight (nothing lost, nothing resurrected).

        A remote tier is shared with other engines and is not wiped: this engine moves to a new namespace
        epoch instead, so its old keys become unreachable (to it) and age out of the store. Live requests
        are keyed again under the new epoch and looked up afresh (a lookup in flight is dropped), and a
        load submitted before the reset is reported failed, so no request sees a pre-reset chunk.
        """
        self.pool.reset()
        if self._write_back is not None:
            self._write_back.clear()
        self._resets += 1
        if self._remote is not None:
            self.keyer.new_epoch(f"reset{self._resets}")
        self._sightings.clear()
        for req in self._requests.values():
            self._abandon(req)
            req.pending = req.answer = req.tail = req.remote_tail = None
            self.keyer.refresh(req.chain)
            req.saved_chunks = len(req.chain.keys)  # chunks computed before the reset are not saved again
            req.tails_saved = None  # nor the tails of the chunk after them
            req.chain_sent = 0  # the chain is resent under the new keys

    def take_events(self) -> tuple[PoolEvent, ...]:
        """The pool's events since the last call, then the remote tiers' (``PoolEvent.tier``): chunks
        whose every shard a save or write-back stored there. A remote tier's evictions are its own (other
        engines share it, or its server evicts): no event says a chunk left one."""
        events = self.pool.take_events()
        if self._tier_events:
            events, self._tier_events = (*events, *self._tier_events), []
        return events

    def close(self) -> None:
        """Release the remote index (its threads and connections); the scheduler answers misses after."""
        if self._remote_index is not None:
            close_quietly(self._remote_index)
            self._remote = self._remote_index = None

    def in_flight(self) -> int:
        return len(self._ops)

    def stats(self) -> SchedulerStats:
        found = self._tier_found()
        return SchedulerStats(
            **self._counters,
            pool=self.pool.usage(),
            requests=len(self._requests),
            ops_in_flight=len(self._ops),
            tier_found=found,
            tier_usage=self._tier_usage(),
            tier_stored=tuple(self._tier_stored.get(t, 0) for t in range(len(found))),
        )

    def _tier_usage(self) -> tuple[TierUsage | None, ...]:
        if isinstance(self._remote_index, CascadeIndex):
            return self._remote_index.usage()
        return () if self._remote_index is None else (tier_usage(self._remote_index),)

    def _tier_found(self) -> tuple[int, ...]:
        if isinstance(self._remote_index, CascadeIndex):
            return tuple(self._remote_index.found)
        return () if self._remote_index is None else (self._remote_found,)

    # -- internals ---------------------------------------------------------------------------------------

    def _answer(self, req: _Request) -> int | None:
        """Leading chunks the tiers hold, or ``None`` while the remote lookup is pending. A sliding-window
        engine's pool alone: the chunks up to the last one it holds (``_fit_window`` then finds a stop
        whose window it holds)."""
        keys = req.chain.keys
        if req.pending is None and self._windowed:
            last_held = (i + 1 for i in range(len(keys) - 1, -1, -1) if self.pool.lookup((keys[i],)))
            req.local_hits = next(last_held, 0)
            return req.local_hits
        if req.pending is None:
            req.local_hits = self._index.lookup([(k,) for k in keys])
            req.remote_tail = None
            if self._remote is None or req.local_hits == len(keys):
                return req.local_hits  # at once: the pool's tails only, no wait on the remote tier
            # the prompt's tail is the chain's next position, asked after its chunks in the same lookup
            tail = self._tail_at(req, req.prompt_tokens)
            if tail is not None and tail.chunk != len(keys):
                tail = None
            req.remote_tail = tail
            held = self._remote.holds  # every rank's key: each rank that reads a chunk holds its lock
            ranked = [*req.chain.rank_keys, *((tail.rank_keys,) if tail is not None else ())]
            chunks = ranked if held else [tuple(dict.fromkeys(shards)) for shards in ranked]
            begun: int | PendingLookup | None = self._remote.begin(
                chunks[req.local_hits :], chunks[: req.local_hits], held=held
            )
        else:
            begun = self._remote.resume(req.pending) if self._remote is not None else 0
        if isinstance(begun, PendingLookup):
            req.pending = begun
            return None
        if begun is None:
            return None
        if req.pending is not None and self._remote is not None:
            self._release_held(req)
            req.held = self._remote.take_held(req.pending)
            if not begun:
                self._release_held(req)
        req.pending = None
        if req.local_hits + begun <= len(keys):
            req.remote_tail = None  # not found
        self._remote_found += max(begun, 0)
        return min(req.local_hits + begun, len(keys))

    def _fit_window(self, req: _Request, load: LoadSpec | None) -> LoadSpec | None:
        """A sliding-window engine's pool alone: ``load`` lowered to the highest stop whose window (the
        chunks holding tokens ``[stop - window_tokens, stop)`` past the engine's own hit) the pool holds,
        or ``None``; any other engine's ``load`` as it is. A state's stop is a chunk's end: the state
        after a token inside a chunk is not kept."""
        window = self.engine.window_tokens
        if load is None or window is None or not self._windowed:
            return load
        chunk = self.config.chunk_tokens
        stop = load.stop
        if self._states:
            stop -= stop % chunk
        while stop > load.start:
            needed = range(max(load.start, stop - window) // chunk, (stop - 1) // chunk + 1)
            missing = [i for i in needed if not self._chunk_held(req, i)]
            if not missing:
                return attrs.evolve(load, stop=stop)
            stop = missing[-1] * chunk  # every stop above it needs that chunk too
        return None

    def _chunk_held(self, req: _Request, chunk: int) -> bool:
        """Whether the pool holds request chunk ``chunk`` (a full chunk, or the tail the lookup found)."""
        keys = req.chain.keys
        if chunk < len(keys):
            return bool(self.pool.lookup((keys[chunk],)))
        return req.tail is not None and req.tail.chunk == chunk

    def _tail_span(self, num_tokens: int) -> tuple[int, int]:
        """``(chunk, blocks)``: the whole blocks of the chunk that ``num_tokens`` tokens end in."""
        chunk, rest = divmod(num_tokens, self.config.chunk_tokens)
        return chunk, rest // self.block_tokens

    def _tail_at(self, req: _Request, num_tokens: int) -> _Tail | None:
        """The tail that ends at the last whole block of the request's first ``num_tokens`` tokens, if it
        has one (``partial_chunks: keep``) and its key is known."""
        if not self.keyer.tails:
            return None
        chunk, blocks = self._tail_span(num_tokens)
        keys = self.keyer.tail_keys(req.chain, chunk, blocks) if blocks else None
        return None if keys is None else _Tail(chunk, keys[0], blocks, keys[1])

    def _tail_hit(self, req: _Request, chunk: int) -> _Tail | None:
        """The longest tail of request chunk ``chunk`` (the first one no tier holds) in the local pool;
        the remote tier is asked for the prompt's tail alone, in the lookup (``_answer``)."""
        if not self.keyer.tails or self._direct:
            return None
        for blocks in range(self.blocks_per_chunk - 1, 0, -1):
            key = self.keyer.tail_key(req.chain, chunk, blocks)
            if key is not None and self.pool.lookup((key,)):
                return _Tail(chunk, key, blocks)
        return None

    def _tail_to_save(
        self,
        req: _Request,
        table: Sequence[int | None],
        num_tokens: int,
        final: bool,
        tokens: Sequence[int] | None,
        block_hashes: Sequence[bytes] | None,
        hash_block_tokens: int | None,
    ) -> _Tail | None:
        """The tail ``save`` keeps now: at the prompt's end once it is computed, at the request's end
        when ``final``; each once, and only from blocks the engine holds."""
        if req.tails_saved is None or not (final or num_tokens >= req.prompt_tokens):
            return None
        point = num_tokens if final else req.prompt_tokens
        chunk, blocks = self._tail_span(point)
        first = chunk * self.blocks_per_chunk
        if not blocks or (chunk, blocks) in req.tails_saved or len(table) < first + blocks:
            return None
        if self._direct and req.tail is not None and (req.tail.chunk, req.tail.blocks) == (chunk, blocks):
            return None  # the remote tier holds it: its lookup found it
        if None in table[first : first + blocks]:
            return None
        if tokens is not None or block_hashes is not None:
            self.keyer.follow(req.chain, tokens, block_hashes, hash_block_tokens)
        req.tails_saved.add((chunk, blocks))
        return self._tail_at(req, point)

    def _abandon(self, req: _Request) -> None:
        """Drop the request's remote lookup in flight and release the locks its answer holds."""
        if self._remote is not None and req.pending is not None:
            self._remote.abandon(req.pending)
        self._release_held(req)

    def _release_held(self, req: _Request) -> None:
        held, req.held = req.held, None
        if held is not None and self._remote is not None:
            self._remote.release_held(held)

    def _submit(
        self,
        request_id: RequestId,
        direction: Direction,
        draft: OpDraft,
        held: HeldChunks | None = None,
        tail: _Tail | None = None,
    ) -> None:
        """Queue the drafted op. One with remote chunks carries the request's chain positions up to
        ``draft.through`` (one past its last remote chunk; with ``held``, at least its end) that no
        earlier op carried. Where that reaches ``tail`` (its chunk is the chain's position after its full
        chunks), the chain ends with the tail's keys, and the next op carries that position again."""
        chain: tuple[tuple[ChunkKey, ...], ...] = ()
        chain_from = 0
        if draft.remote:
            req = self._requests[request_id]
            ranked = req.chain.rank_keys
            through = max(draft.through, held.end if held is not None else 0)
            if tail is not None and through > tail.chunk:
                chain_from = min(req.chain_sent, tail.chunk)
                chain = (*ranked[chain_from : tail.chunk], tail.rank_keys)
                req.chain_sent = tail.chunk
            else:
                chain_from, chain = req.chain_sent, ranked[req.chain_sent : through]
                req.chain_sent = max(req.chain_sent, through)
        op = BlockOp(
            self._ops.next_id(),
            direction,
            draft.engine_blocks,
            draft.host_blocks,
            request_id,
            tuple(draft.remote),
            chain_from,
            chain,
            held,
        )
        keys = tuple(draft.keys)
        role = JobRole.LOAD if direction is Direction.LOAD else JobRole.SAVE
        self._table.add_job(request_id, JobId(op.op_id), role, keys)
        self._ops.add(request_id, op, keys, draft.sizes, self._resets, frozenset(draft.fetched))
        self._plan.append(op)

    def _finish_op(self, entry: InFlightOp) -> None:
        op = entry.op
        if op.remote and op.direction is Direction.SAVE and entry.epoch == self._resets:
            for tier, keys in sorted(entry.tiers_holding().items()):
                self._tier_events.append(PoolEvent(PoolEventKind.STORED, tuple(keys), tier + 1))
                self._tier_stored[tier] = self._tier_stored.get(tier, 0) + len(keys)
        if op.write_back and self._write_back is not None:
            self._write_back.finish(entry.keys)
            self._counters["written_back_chunks"] += len(entry.keys)
            self._counters["failed_write_back_chunks"] += len(entry.failed)
            return
        if op.direction is Direction.LOAD and entry.epoch != self._resets:
            entry.failed.update(range(len(op.engine_blocks)))  # loaded before a reset: pre-reset KV
        failed = set(entry.failed_chunks())
        if op.direction is Direction.LOAD:
            self.pool.unpin([k for k in entry.keys if k not in entry.fetched])
            fetched = [k for k in entry.keys if k in entry.fetched]
            self.pool.complete_store([k for k in fetched if k not in failed], success=True)
            self.pool.complete_store([k for k in fetched if k in failed], success=False)
            if entry.suspect:  # a chunk whose bytes failed to load is suspect: never serve it again
                suspect = [k for k in failed if k not in entry.fetched]
                self.pool.remove(suspect)
                if self._write_back is not None:
                    self._write_back.forget(suspect)
            self._counters["loaded_blocks"] += len(op.engine_blocks) - len(entry.failed)
            self._counters["failed_load_blocks"] += len(entry.failed)
            req = self._requests.get(entry.request_id)
            if entry.failed and req is not None and not entry.fenced:
                req.load_errors.extend(op.engine_blocks[i] for i in sorted(entry.failed))
                if req.loaded is not None:  # the op's blocks are the request's from ``load_from`` on
                    req.failed_blocks.update(req.load_from + i for i in entry.failed)
                    req.stop_answer_at((req.load_from + min(entry.failed)) // self.blocks_per_chunk)
        else:
            good = tuple(k for k in entry.keys if k not in failed)
            dropped = tuple(k for k in entry.keys if k in failed)
            if self._write_back is not None:
                self._write_back.store(set(good), zip(entry.remote_keys(), op.remote, strict=True))
            else:
                self.pool.complete_store(good, success=True)
            if dropped:
                self.pool.complete_store(dropped, success=False)
                self._counters["failed_save_chunks"] += len(dropped)
                self._save_again(entry, dropped)
            sizes = zip(entry.keys, entry.sizes, strict=True)
            self._counters["saved_blocks"] += sum(size for key, size in sizes if key not in failed)
        done = self._table.complete_job(JobId(op.op_id))
        if done is not None:
            self._retire(done[1])

    def _save_again(self, entry: InFlightOp, dropped: Sequence[ChunkKey]) -> None:
        """A live request's next ``save`` retries the chunks a failed or fenced save dropped (from its
        blocks then), unless a reset came between: what was computed before it is never saved."""
        req = self._requests.get(entry.request_id)
        tracker = self._table.get(entry.request_id)
        if req is None or tracker is None or tracker.ended or entry.epoch != self._resets:
            return
        position = {key: i for i, key in enumerate(req.chain.keys)}
        first = min((position[k] for k in dropped if k in position), default=req.saved_chunks)
        req.saved_chunks = min(req.saved_chunks, first)

    def _retire(self, tracker: RequestTracker) -> None:
        if tracker.phase in (Phase.FINISHED, Phase.ABORTED) and not tracker.jobs:
            self._finished.append(tracker.request_id)
            self._requests.pop(tracker.request_id, None)

    def _end(self, request_id: RequestId, phase: Phase) -> bool:
        req = self._requests.get(request_id)
        if req is not None:
            self._abandon(req)
            req.pending = None
            if self._remote_index is not None:
                self._ended.append(request_id)
        delayed = self._table.end(request_id, phase)
        if not delayed:
            self._requests.pop(request_id, None)
        return delayed
