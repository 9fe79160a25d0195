"""Planning a load: the load a lookup decided, into the blocks the engine allocated. Each chunk comes from
the pool (pinned first, so that no fetch evicts a chunk this very load needs) or from the remote tier
(fetched into a slot reserved for it); what left the pool since the lookup, or finds no slot, is given up
before any copy and reported for recompute. Then the blocks whose load failed, for the engine."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import attrs

from kvcore.checks import check_block_table
from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey, RequestId
from kvcore.ports import Direction
from kvcore.scheduling.load_spec import ChunkPiece
from kvcore.scheduling.op_draft import OpDraft
from kvcore.scheduling.state import SchedulerState
from kvcore.scheduling.submission import submit

__all__ = ["start_load", "take_load_errors", "take_lost_blocks"]

log = logging.getLogger(__name__)


def start_load(
    state: SchedulerState, request_id: RequestId, block_ids: Sequence[int | None], is_async: bool
) -> int:
    """``CacheScheduler.start_load``: queue the decided load into ``block_ids``; the tokens queued."""
    table = check_block_table("block_ids", block_ids, state.engine.layout.num_blocks)
    req = state.requests.get(request_id)
    tracker = state.table.get(request_id)
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
    written = attrs.evolve(spec, start=max(spec.start, (spec.first_block + skipped) * state.block_tokens))
    req.load_from = written.first_block
    draft = OpDraft(state.blocks_per_chunk)
    # Which pieces come from the pool and which from the remote tier; the pool's are pinned before any
    # fetch reserves a slot, so that no fetch evicts a chunk this very load needs.
    sources: list[tuple[ChunkPiece, ChunkKey, bool]] = []
    for piece in written.pieces(state.config.chunk_tokens) if skipped < len(needed) else ():
        tail = req.tail if req.tail is not None and req.tail.chunk == piece.chunk else None
        if tail is None and piece.chunk >= len(req.chain.keys):
            break  # the tail this load was decided with failed since: its blocks are recomputed
        key = tail.key if tail is not None else req.chain.keys[piece.chunk]
        if state.pool.lookup((key,)):
            sources.append((piece, key, True))
        elif state.remote is not None and (piece.chunk < (req.hit_chunks or 0) or (tail and tail.remote)):
            sources.append((piece, key, False))
        else:
            break  # the chunk left the pool since the lookup
    state.pool.pin([key for _, key, local in sources if local])
    why = "left the pool before loading"
    for n, (piece, key, local) in enumerate(sources):
        tail = req.tail if req.tail is not None and req.tail.key == key else None
        slot: int | None = None
        if local:
            slot = state.pool.slots_of((key,))[0]
        elif not state.no_pool:
            reserved = state.pool.prepare_store((key,)).slots
            if not reserved:  # no free slot, or the chunk is being saved now: recompute from here
                state.pool.unpin([k for _, k, loc in sources[n:] if loc])
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
        req.unloaded = (state.plans, lost_from)
        req.stop_hit_at(lost_from // state.blocks_per_chunk)
        req.failed_blocks.update(range(lost_from, spec.first_block + spec.num_blocks))
        req.load_errors.extend(ids[lost_from : spec.first_block + spec.num_blocks])
        req.lost_blocks.extend(ids[lost_from : spec.first_block + spec.num_blocks])
    held, req.held = req.held, None
    if held is not None:
        if state.remote is None:  # closed: the index dropped its locks
            held = None
        elif not draft.fetched:  # the load reads nothing remote: no worker will take the locks
            state.remote.release_held(held)
            held = None
        elif not state.remote.hand_over(held):  # too old to hand over: released
            held = None
    if not loaded and skipped < len(needed):
        return 0
    if loaded:
        submit(state, request_id, Direction.LOAD, draft, held, req.remote_tail)
    queued = spec.tokens_in(skipped + loaded)
    state.counters["hit_tokens"] += queued
    state.counters["async_loads"] += is_async
    return queued


def take_lost_blocks(state: SchedulerState) -> tuple[int, ...]:
    """``CacheScheduler.take_lost_blocks``: the blocks given up before any copy, since the last call."""
    lost: list[int] = []
    for req in state.requests.values():
        lost.extend(req.lost_blocks)
        req.lost_blocks.clear()
        req.load_errors.clear()
    return tuple(lost)


def take_load_errors(state: SchedulerState) -> dict[RequestId, tuple[int, ...]]:
    """``CacheScheduler.take_load_errors``: the blocks whose load failed, per request, since the last
    call."""
    out = {}
    for request_id, req in state.requests.items():
        if req.load_errors:
            out[request_id] = tuple(req.load_errors)
            req.load_errors.clear()
            req.lost_blocks.clear()
    return out
