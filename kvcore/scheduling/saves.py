"""Planning a save: a request's full chunks whose KV is computed (and the tail it keeps now), less what
the pool holds, what its sightings do not admit yet and what does not fit, into slots reserved for them;
each rank's shard crosses to the remote tier where the rank writes it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvcore.checks import check_block_table, is_int_in
from kvcore.errors import InvalidSpecError
from kvcore.ids import ChunkKey, RequestId
from kvcore.ports import Direction
from kvcore.scheduling.op_draft import OpDraft
from kvcore.scheduling.request_keys import token_sequence
from kvcore.scheduling.state import SchedulerState
from kvcore.scheduling.submission import submit
from kvcore.scheduling.tails import tail_span, tail_to_save

__all__ = ["save"]


def save(
    state: SchedulerState,
    request_id: RequestId,
    block_ids: Sequence[int | None],
    num_tokens: int,
    tokens: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
    hash_block_tokens: int | None,
    final: bool,
) -> int:
    """``CacheScheduler.save``: queue the saves of the request's computed chunks; the chunks queued."""
    table = check_block_table("block_ids", block_ids, state.engine.layout.num_blocks)
    if not is_int_in(num_tokens, 0):
        raise InvalidSpecError(f"num_tokens: got {num_tokens!r}, expected an integer >= 0")
    if tokens is not None:
        token_sequence(tokens)
    req = state.requests.get(request_id)
    tracker = state.table.get(request_id)
    if req is None or tracker is None or tracker.ended:
        return 0
    chain = req.chain
    if (tokens is not None and chain.by_hashes) or (block_hashes is not None and not chain.by_hashes):
        given = "tokens" if tokens is not None else "block_hashes"
        raise InvalidSpecError(
            f"{given}: request {request_id} was looked up by the other kind of key; its keys cannot "
            f"grow from {given}"
        )
    chunk_tokens = state.config.chunk_tokens
    full = num_tokens // chunk_tokens
    if full > chain.full_chunks(chunk_tokens) and (tokens is not None or block_hashes is not None):
        if block_hashes is not None:
            changed = state.keyer.rekey(chain, block_hashes, hash_block_tokens)
        else:
            changed = state.keyer.extend(chain, tokens or ())
        req.chain_sent = min(req.chain_sent, changed)  # the first key not sent yet under its name
    per = state.blocks_per_chunk
    full = min(full, chain.full_chunks(chunk_tokens), len(table) // per)
    # blocks this plan's load gave up hold no KV of the request yet, nor do the blocks the engine
    # computes after them in this step (their attention read those): saved once recomputed
    unloaded = req.unloaded[1] if req.unloaded is not None and req.unloaded[0] == state.plans else None
    if unloaded is not None:
        full = min(full, unloaded // per)
        num_tokens = min(num_tokens, unloaded * state.block_tokens)
    # without a local tier, the chunks the remote tier held at lookup are not sent to it again
    start = max(req.saved_chunks, req.hit_chunks or 0) if state.no_pool else req.saved_chunks
    whole = [i for i in range(start, full) if None not in table[i * per : (i + 1) * per]]
    ids = cast(tuple[int, ...], table)  # only whole chunks and tails (no hole) are read below
    wanted = list(state.sightings.admitted([chain.keys[i] for i in whole]))
    tail = tail_to_save(state, req, table, num_tokens, final, tokens, block_hashes, hash_block_tokens)
    # only the prompt's tail crosses: a remote lookup asks for no other
    crosses = (
        tail is not None
        and state.remote is not None
        and tail.chunk == len(chain.keys)
        and (tail.chunk, tail.blocks) == tail_span(state, req.prompt_tokens)
    )
    if tail is not None and (crosses or not state.no_pool) and state.sightings.admitted([tail.key]):
        wanted.append(tail.key)
    else:
        tail = None
    if full > start:
        req.saved_chunks = full
    if not wanted:
        return 0
    slots: Sequence[tuple[ChunkKey, int | None]] = (
        [(key, None) for key in wanted] if state.no_pool else state.pool.prepare_store(wanted).slots
    )
    if not slots:
        return 0
    draft = OpDraft(per)
    writers = state.keyer.shard_writers
    position = {chain.keys[i]: i for i in whole}
    for key, slot in slots:
        this = tail if tail is not None and key == tail.key else None
        chunk = this.chunk if this is not None else position[key]
        owned = None  # a shared tier is written by one rank of each group of replicas
        if state.remote is not None and (this is None or crosses):
            shards = this.rank_keys if this is not None else chain.rank_keys[chunk]
            owned = tuple(k if w else None for k, w in zip(shards, writers, strict=True))
        blocks = this.blocks if this is not None else None
        draft.add(key, chunk, ids, slot, num_blocks=blocks, shard_keys=owned, value_blocks=blocks)
    submit(state, request_id, Direction.SAVE, draft, tail=tail if crosses else None)
    return len(draft.keys)
