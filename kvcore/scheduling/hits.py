"""Finding a request's hit: how many leading chunks the tiers hold (the pool at once, the remote index for
the rest, with the prompt's tail after the chain), the longest tail after them, and the load that follows
(``load_spec.plan_load``), lowered for a sliding window to a stop whose window the pool holds."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvcore.checks import is_int_in
from kvcore.errors import InvalidSpecError
from kvcore.ids import RequestId
from kvcore.keying.hashing import ExtraKeys
from kvcore.keying.keys import lookup_keys
from kvcore.ports import Direction
from kvcore.scheduling.load_spec import LoadSpec, check_local_tokens, hit_tokens, plan_load
from kvcore.scheduling.remote_lookup import PendingLookup
from kvcore.scheduling.request_keys import prompt_tokens
from kvcore.scheduling.requests import RequestState
from kvcore.scheduling.state import SchedulerState
from kvcore.scheduling.tails import tail_at, tail_hit

__all__ = ["cap_load", "load_reads_remote", "lookup"]


def lookup(
    state: SchedulerState,
    request_id: RequestId,
    tokens: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
    hash_block_tokens: int | None,
    num_tokens: int | None,
    local_tokens: int,
    extra: ExtraKeys,
) -> int | None:
    """``CacheScheduler.lookup``: the tokens the tiers can load beyond ``local_tokens``, or ``None``
    while the remote index's answer is pending."""
    if tokens is not None and block_hashes is not None:
        raise InvalidSpecError("lookup: give tokens or block_hashes, not both")
    if not isinstance(extra, ExtraKeys):
        raise InvalidSpecError(f"extra: got {extra!r}, expected ExtraKeys")
    total = prompt_tokens(tokens, block_hashes, hash_block_tokens, num_tokens)
    check_local_tokens(total, local_tokens, state.block_tokens)
    req = state.requests.get(request_id)
    if req is None:
        # may raise: nothing is recorded yet
        req = RequestState(state.keyer.chain(extra, tokens, block_hashes, hash_block_tokens), total)
        state.requests[request_id] = req
        state.table.track(request_id)
        state.counters["lookups"] += 1
        if state.sightings.active:  # the prompt's tail is admitted by its sightings too
            prompt_tail = tail_at(state, req, total)
            tail_keys = () if prompt_tail is None else (prompt_tail.key,)
            state.sightings.sight((*req.chain.keys, *tail_keys))
    tracker = state.table.get(request_id)
    if tracker is None or tracker.ended:
        return 0
    if req.hit_chunks is None:
        req.hit_chunks = _leading_held(state, req)
        if req.hit_chunks is None:
            return None  # a remote lookup is pending: ask again next step
        req.tail = tail_hit(state, req, req.hit_chunks)
        found = req.remote_tail
        if found is not None and (req.tail is None or req.tail.blocks < found.blocks):
            req.tail = attrs.evolve(found, remote=True)
    external = hit_tokens(req.hit_chunks, req.chain.token_counts)
    if req.tail is not None:
        external += req.tail.blocks * state.block_tokens
    req.load = _fit_window(
        state,
        req,
        plan_load(
            prompt_tokens=total,
            local_tokens=local_tokens,
            external_tokens=external,
            block_tokens=state.block_tokens,
        ),
    )
    if req.load is None:
        state.release_held(req)
        return 0
    if _loading_elsewhere(state, request_id, req):
        return None  # another request's load writes these chunks into the engine: ask again after it
    return req.load.num_tokens


def _loading_elsewhere(state: SchedulerState, request_id: RequestId, req: RequestState) -> bool:
    """Whether an asynchronous load of another request, still in flight, brings in a chunk this request's
    load would read. Requests that share a prefix and arrive together would each load it: the engine
    finds a chunk an asynchronous load writes in its own cache only once that load has ended (a
    synchronous load's blocks are in it at once). This one waits instead, and finds the chunk in the
    engine's cache when that load ends, or loads it itself if it failed; bounded by that load's own
    timeout."""
    load = req.load
    if load is None or not len(state.ops):
        return False
    chunk = state.config.chunk_tokens
    wanted = set(req.chain.keys[load.start // chunk : -(-load.stop // chunk)])
    if req.tail is not None:
        wanted.add(req.tail.key)
    for entry in state.ops:
        other = state.requests.get(entry.request_id) if entry.request_id != request_id else None
        if (
            other is not None
            and other.loaded is not None
            and other.loaded.is_async
            and entry.op.direction is Direction.LOAD
            and not entry.fenced
            and not wanted.isdisjoint(entry.keys)
        ):
            return True
    return False


def cap_load(state: SchedulerState, request_id: RequestId, num_tokens: int) -> int:
    """``CacheScheduler.cap_load``: the decided load lowered to its first ``num_tokens`` tokens."""
    if not is_int_in(num_tokens, 0):
        raise InvalidSpecError(f"num_tokens: got {num_tokens!r}, expected an integer >= 0")
    req = state.requests.get(request_id)
    if req is None or req.load is None:
        return 0
    if num_tokens >= req.load.num_tokens:
        return req.load.num_tokens
    capped = attrs.evolve(req.load, stop=req.load.start + num_tokens) if num_tokens else None
    req.load = _fit_window(state, req, capped)
    if req.load is None:
        state.release_held(req)
        return 0
    return req.load.num_tokens


def load_reads_remote(state: SchedulerState, request_id: RequestId) -> bool:
    """``CacheScheduler.load_reads_remote``: whether the decided load reads a chunk the pool lacked."""
    req = state.requests.get(request_id)
    if req is None or req.load is None or state.remote is None:
        return False
    chunk = state.config.chunk_tokens
    first = max(req.load.start // chunk, req.local_hits)
    remote_tail = req.tail is not None and req.tail.remote
    last = min((req.load.stop - 1) // chunk, (req.hit_chunks or 0) - 1 + remote_tail)
    return state.no_pool or last >= first


def _leading_held(state: SchedulerState, req: RequestState) -> int | None:
    """Leading chunks the tiers hold, or ``None`` while the remote lookup is pending. A sliding-window
    engine's pool alone: the chunks up to the last one it holds (``_fit_window`` then finds a stop whose
    window it holds)."""
    keys = req.chain.keys
    if req.pending is None and state.windowed:
        last_held = (i + 1 for i in range(len(keys) - 1, -1, -1) if state.pool.lookup((keys[i],)))
        req.local_hits = next(last_held, 0)
        return req.local_hits
    if req.pending is None:
        req.local_hits = state.pool_index.lookup([(k,) for k in keys])
        req.remote_tail = None
        if state.remote is None or req.local_hits == len(keys):
            return req.local_hits  # at once: the pool's tails only, no wait on the remote tier
        # the prompt's tail is the chain's next position, asked after its chunks in the same lookup
        tail = tail_at(state, req, req.prompt_tokens)
        if tail is not None and tail.chunk != len(keys):
            tail = None
        req.remote_tail = tail
        held = state.remote.holds  # every rank's key: each rank that reads a chunk holds its lock
        ranked = [*req.chain.rank_keys, *((tail.rank_keys,) if tail is not None else ())]
        per_head = state.remote_per_head
        chunks = ranked if held else [lookup_keys(shards, per_head=per_head) for shards in ranked]
        begun: int | PendingLookup | None = state.remote.begin(
            chunks[req.local_hits :], chunks[: req.local_hits], held=held
        )
    else:
        begun = state.remote.resume(req.pending) if state.remote is not None else 0
    if isinstance(begun, PendingLookup):
        req.pending = begun
        return None
    if begun is None:
        return None
    if req.pending is not None and state.remote is not None:
        state.release_held(req)
        req.held = state.remote.take_held(req.pending)
        if not begun:
            state.release_held(req)
    req.pending = None
    if req.local_hits + begun <= len(keys):
        req.remote_tail = None  # not found
    state.remote_found += max(begun, 0)
    return min(req.local_hits + begun, len(keys))


def _fit_window(state: SchedulerState, req: RequestState, load: LoadSpec | None) -> LoadSpec | None:
    """A sliding-window engine's pool alone: ``load`` lowered to the highest stop whose window (the chunks
    holding tokens ``[stop - window_tokens, stop)`` past the engine's own hit) the pool holds, or
    ``None``; any other engine's ``load`` as it is. A state's stop is a chunk's end: the state after a
    token inside a chunk is not kept."""
    window = state.engine.window_tokens
    if load is None or window is None or not state.windowed:
        return load
    chunk = state.config.chunk_tokens
    stop = load.stop
    if state.states:
        stop -= stop % chunk
    while stop > load.start:
        needed = range(max(load.start, stop - window) // chunk, (stop - 1) // chunk + 1)
        missing = [i for i in needed if not _chunk_held(state, req, i)]
        if not missing:
            return attrs.evolve(load, stop=stop)
        stop = missing[-1] * chunk  # every stop above it needs that chunk too
    return None


def _chunk_held(state: SchedulerState, req: RequestState, chunk: int) -> bool:
    """Whether the pool holds request chunk ``chunk`` (a full chunk, or the tail the lookup found)."""
    keys = req.chain.keys
    if chunk < len(keys):
        return bool(state.pool.lookup((keys[chunk],)))
    return req.tail is not None and req.tail.chunk == chunk
