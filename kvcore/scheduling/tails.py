"""Tails (``partial_chunks: keep``): the leading whole blocks of a chunk, kept under a key of their own
(docs/architecture.md, "tail"). Where a request's tail ends, which one the pool holds, and which one a
save keeps now."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.scheduling.requests import RequestState, Tail
from kvcore.scheduling.state import SchedulerState

__all__ = ["tail_at", "tail_hit", "tail_span", "tail_to_save"]


def tail_span(state: SchedulerState, num_tokens: int) -> tuple[int, int]:
    """``(chunk, blocks)``: the whole blocks of the chunk that ``num_tokens`` tokens end in."""
    chunk, rest = divmod(num_tokens, state.config.chunk_tokens)
    return chunk, rest // state.block_tokens


def tail_at(state: SchedulerState, req: RequestState, num_tokens: int) -> Tail | None:
    """The tail that ends at the last whole block of the request's first ``num_tokens`` tokens, if it has
    one (``partial_chunks: keep``) and its key is known."""
    if not state.keyer.tails:
        return None
    chunk, blocks = tail_span(state, num_tokens)
    keys = state.keyer.tail_keys(req.chain, chunk, blocks) if blocks else None
    return None if keys is None else Tail(chunk, keys[0], blocks, keys[1])


def tail_hit(state: SchedulerState, req: RequestState, chunk: int) -> Tail | None:
    """The longest tail of request chunk ``chunk`` (the first one no tier holds) in the local pool; the
    remote tier is asked for the prompt's tail alone, in the lookup (``hits``)."""
    if not state.keyer.tails or state.no_pool:
        return None
    for blocks in range(state.blocks_per_chunk - 1, 0, -1):
        key = state.keyer.tail_key(req.chain, chunk, blocks)
        if key is not None and state.pool.lookup((key,)):
            return Tail(chunk, key, blocks)
    return None


def tail_to_save(
    state: SchedulerState,
    req: RequestState,
    table: Sequence[int | None],
    num_tokens: int,
    final: bool,
    tokens: Sequence[int] | None,
    block_hashes: Sequence[bytes] | None,
    hash_block_tokens: int | None,
) -> Tail | None:
    """The tail a save keeps now: at the prompt's end once it is computed, at the request's end when
    ``final``; each once, and only from blocks the engine holds."""
    if req.tails_saved is None or not (final or num_tokens >= req.prompt_tokens):
        return None
    point = num_tokens if final else req.prompt_tokens
    chunk, blocks = tail_span(state, point)
    first = chunk * state.blocks_per_chunk
    if not blocks or (chunk, blocks) in req.tails_saved or len(table) < first + blocks:
        return None
    if state.no_pool and req.tail is not None and (req.tail.chunk, req.tail.blocks) == (chunk, blocks):
        return None  # the remote tier holds it: its lookup found it
    if None in table[first : first + blocks]:
        return None
    if tokens is not None or block_hashes is not None:
        state.keyer.follow(req.chain, tokens, block_hashes, hash_block_tokens)
    req.tails_saved.add((chunk, blocks))
    return tail_at(state, req, point)
