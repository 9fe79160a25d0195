"""Completion: the workers' reports of an op, once every rank sent one. Only then are pins released and
stores published (a copy in flight may still read or write a slot): a load's fetched chunks join the pool
or leave it, a failed load's blocks go to the engine for recompute and its chunks that failed stay out of
the pool; a save's chunks are published (dirty where they cross to tiers written back) or dropped and
saved again from the request's blocks (counted once however often it fails, its retries apart); a
request whose last op ended is retired."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.model.step import OpReport
from kvcore.pool.block_pool import PoolEvent, PoolEventKind
from kvcore.ports import Direction
from kvcore.scheduling.ledger import InFlightOp
from kvcore.scheduling.lifecycle import Phase, RequestTracker
from kvcore.scheduling.state import Resaves, SchedulerState

__all__ = ["complete", "retire"]


def complete(state: SchedulerState, reports: Iterable[OpReport]) -> None:
    """``CacheScheduler.complete``: account reports; an op is done once every rank reported it."""
    for report in reports:
        entry = state.ops.report(report)
        if entry is not None:
            _finish(state, entry)


def retire(state: SchedulerState, tracker: RequestTracker) -> None:
    """Forget a request that ended, once none of its ops is in flight (its delayed free is over)."""
    if tracker.phase in (Phase.FINISHED, Phase.ABORTED) and not tracker.jobs:
        state.finished.append(tracker.request_id)
        state.forget(tracker.request_id)


def _finish(state: SchedulerState, entry: InFlightOp) -> None:
    op = entry.op
    if op.remote and op.direction is Direction.SAVE and entry.epoch == state.resets:
        resaves = _resaves(state, entry.request_id, create=False)
        stored = resaves.stored if resaves is not None else set()  # counted when first stored
        for tier, keys in sorted(entry.tiers_holding().items()):
            state.tier_events.append(PoolEvent(PoolEventKind.STORED, tuple(keys), tier + 1))
            state.tier_stored[tier] = state.tier_stored.get(tier, 0) + sum(k not in stored for k in keys)
    if op.write_back and state.write_back is not None:
        state.write_back.finish(entry.keys)
        state.counters["written_back_chunks"] += len(entry.keys)
        state.counters["failed_write_back_chunks"] += len(entry.failed)
        return
    if op.direction is Direction.LOAD:
        _finish_load(state, entry)
    else:
        _finish_save(state, entry)
    done = state.table.complete_job(JobId(op.op_id))
    if done is not None:
        retire(state, done[1])


def _finish_load(state: SchedulerState, entry: InFlightOp) -> None:
    op = entry.op
    if entry.epoch != state.resets:
        entry.failed.update(range(len(op.engine_blocks)))  # loaded before a reset: pre-reset KV
    failed = set(entry.failed_chunks())
    state.pool.unpin([k for k in entry.keys if k not in entry.fetched])
    fetched = [k for k in entry.keys if k in entry.fetched]
    state.pool.complete_store([k for k in fetched if k not in failed], success=True)
    if state.assembles:
        state.counters["assembled_chunks"] += sum(1 for k in fetched if k not in failed)
    state.pool.complete_store([k for k in fetched if k in failed], success=False)
    if entry.suspect:  # a chunk whose bytes failed to load is suspect: never serve it again
        suspect = [k for k in failed if k not in entry.fetched]
        state.pool.remove(suspect)
        if state.write_back is not None:
            state.write_back.forget(suspect)
    state.counters["loaded_blocks"] += len(op.engine_blocks) - len(entry.failed)
    state.counters["failed_load_blocks"] += len(entry.failed)
    req = state.requests.get(entry.request_id)
    if entry.failed and req is not None and not entry.fenced:
        req.load_errors.extend(op.engine_blocks[i] for i in sorted(entry.failed))
        if req.loaded is not None:  # the op's blocks are the request's from ``load_from`` on
            req.failed_blocks.update(req.load_from + i for i in entry.failed)
            req.stop_hit_at((req.load_from + min(entry.failed)) // state.blocks_per_chunk)


def _finish_save(state: SchedulerState, entry: InFlightOp) -> None:
    failed = set(entry.failed_chunks())
    good = tuple(k for k in entry.keys if k not in failed)
    dropped = tuple(k for k in entry.keys if k in failed)
    if state.write_back is not None:
        state.write_back.store(set(good), zip(entry.remote_keys(), entry.op.remote, strict=True))
    else:
        state.pool.complete_store(good, success=True)
    _count_save(state, entry, good, dropped)
    if dropped:
        state.pool.complete_store(dropped, success=False)
        _save_again(state, entry, dropped)


def _count_save(
    state: SchedulerState, entry: InFlightOp, good: Sequence[ChunkKey], dropped: Sequence[ChunkKey]
) -> None:
    """Count a save's chunks, each once however often its request saves it again: a chunk whose save
    failed before counts as a retry (``save_retries``), and in ``failed_save_chunks`` only the first time
    it fails; a chunk stored before (sent again without a pool) adds no saved blocks."""
    resaves = _resaves(state, entry.request_id, create=bool(dropped))
    failed, stored = (resaves.failed, resaves.stored) if resaves is not None else (set(), set())
    sizes = dict(zip(entry.keys, entry.sizes, strict=True))
    state.counters["saved_blocks"] += sum(sizes[k] for k in good if k not in stored)
    state.counters["save_retries"] += sum(k in failed for k in entry.keys)
    lost = [k for k in dropped if k not in failed and k not in stored]
    state.counters["failed_save_chunks"] += len(lost)
    failed.difference_update(good)
    failed.update(lost)
    if state.no_pool:
        stored.update(good)


def _resaves(state: SchedulerState, request_id: RequestId, *, create: bool) -> Resaves | None:
    """The live request's ``Resaves``, made at its first failed save (``create``); ``None`` before it,
    and for a request gone or a write-back's session."""
    resaves = state.resaves.get(request_id)
    if resaves is None and create and request_id in state.requests:
        resaves = state.resaves[request_id] = Resaves()
    return resaves


def _save_again(state: SchedulerState, entry: InFlightOp, dropped: Sequence[ChunkKey]) -> None:
    """A live request's next save retries the chunks a failed or fenced save dropped (from its blocks
    then), unless a reset came between: what was computed before it is never saved."""
    req = state.requests.get(entry.request_id)
    tracker = state.table.get(entry.request_id)
    if req is None or tracker is None or tracker.ended or entry.epoch != state.resets:
        return
    position = {key: i for i, key in enumerate(req.chain.keys)}
    first = min((position[k] for k in dropped if k in position), default=req.saved_chunks)
    req.saved_chunks = min(req.saved_chunks, first)
