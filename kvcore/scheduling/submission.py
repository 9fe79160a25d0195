"""Submitting an op: a drafted load or save becomes a ``BlockOp`` of the step's plan, carrying the part of
its request's chain the workers have not had yet, and is booked with its request and in the ledger."""

from __future__ import annotations

from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.model.step import BlockOp
from kvcore.ports import Direction, HeldChunks
from kvcore.scheduling.lifecycle import JobRole
from kvcore.scheduling.op_draft import OpDraft
from kvcore.scheduling.requests import Tail
from kvcore.scheduling.state import SchedulerState

__all__ = ["submit"]


def submit(
    state: SchedulerState,
    request_id: RequestId,
    direction: Direction,
    draft: OpDraft,
    held: HeldChunks | None = None,
    tail: Tail | None = None,
) -> None:
    """Queue the drafted op. One with remote chunks carries the request's chain positions up to
    ``draft.chain_end`` (with ``held``, at least its end) that no earlier op carried. Where that reaches
    ``tail`` (its chunk is the chain's position after its full chunks), the chain ends with the tail's
    keys, and the next op carries that position again."""
    chain: tuple[tuple[ChunkKey, ...], ...] = ()
    chain_from = 0
    if draft.remote:
        req = state.requests[request_id]
        ranked = req.chain.rank_keys
        end = max(draft.chain_end, held.end if held is not None else 0)
        if tail is not None and end > tail.chunk:
            chain_from = min(req.chain_sent, tail.chunk)
            chain = (*ranked[chain_from : tail.chunk], tail.rank_keys)
            req.chain_sent = tail.chunk
        else:
            chain_from, chain = req.chain_sent, ranked[req.chain_sent : end]
            req.chain_sent = max(req.chain_sent, end)
    op = BlockOp(
        state.ops.next_id(),
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
    state.table.add_job(request_id, JobId(op.op_id), role, keys)
    state.ops.add(request_id, op, keys, draft.sizes, state.resets, frozenset(draft.fetched))
    state.plan.append(op)
