"""Load specs: which blocks of a request to fill from a tier, given what the engine already holds.

The rules: a load starts exactly at the first block the engine does not hold (a block the engine holds is
never written, even inside a chunk) and never covers the whole prompt — at least one token is always
computed, so the engine has logits to sample from. It stops where the tier's hit or the prompt's last token
does, which need not be a block boundary: when the tier holds the whole prompt, everything but its last
token is loaded. Copies move whole blocks, so the last block written may hold positions past the load's
stop; the engine computes those positions (from ``stop`` on) before any token attends to them, and an
engine hashes a block into its own prefix cache only once it is full, so those bytes are never served.
Only what was actually loaded counts as extra cached tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from attrs import field, frozen
from attrs.validators import ge

from kvcore.checks import is_int_in
from kvcore.errors import InvalidSpecError

__all__ = ["ChunkPiece", "LoadSpec", "check_local_tokens", "hit_tokens", "plan_load"]


@frozen
class ChunkPiece:
    """The part of one chunk a load writes: blocks ``[first_block, first_block + num_blocks)`` of it."""

    chunk: int
    first_block: int
    num_blocks: int


@frozen
class LoadSpec:
    """One request's load: tokens ``[start, stop)`` come from the tier, the engine computes the rest.

    ``local_tokens`` is the engine's own prefix hit; ``external_tokens`` what the tier holds (before
    capping to the prompt). ``is_async``: the engine runs the load beside its steps, the request waiting
    for it alone (set when the load starts).
    """

    local_tokens: int = field(validator=ge(0))
    external_tokens: int = field(validator=ge(0))
    start: int = field(validator=ge(0))
    stop: int = field(validator=ge(1))
    block_tokens: int = field(validator=ge(1))
    is_async: bool = False

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    @property
    def first_block(self) -> int:
        """Index, within the request, of the first block written."""
        return self.start // self.block_tokens

    @property
    def num_blocks(self) -> int:
        """Blocks written, the last one partly where ``stop`` is not a block boundary."""
        return -(-self.num_tokens // self.block_tokens)

    def tokens_in(self, num_blocks: int) -> int:
        """Tokens of the load carried by its first ``num_blocks`` blocks."""
        return max(0, min(self.stop, (self.first_block + num_blocks) * self.block_tokens) - self.start)

    def pieces(self, chunk_tokens: int) -> tuple[ChunkPiece, ...]:
        """The chunks this load reads from, and which of their blocks, in request order."""
        if chunk_tokens % self.block_tokens:
            raise InvalidSpecError(
                f"chunk_tokens {chunk_tokens} is not a multiple of block_tokens {self.block_tokens}"
            )
        per_chunk = chunk_tokens // self.block_tokens
        pieces = []
        block, end = self.first_block, self.first_block + self.num_blocks
        while block < end:
            chunk, offset = divmod(block, per_chunk)
            count = min(per_chunk - offset, end - block)
            pieces.append(ChunkPiece(chunk, offset, count))
            block += count
        return tuple(pieces)

    def extra_cached_tokens(self, failed_blocks: Collection[int] = ()) -> int:
        """Tokens served from the tier beyond the engine's own hit, counting only what loaded.

        ``failed_blocks`` are request block indices whose load failed; the engine recomputes from the
        first of them on, so nothing after it counts.
        """
        stop_block = min((b for b in failed_blocks if b >= self.first_block), default=None)
        return self.tokens_in(self.num_blocks if stop_block is None else stop_block - self.first_block)


def hit_tokens(hit_chunks: int, chunk_token_counts: Sequence[int]) -> int:
    """Tokens covered by the first ``hit_chunks`` chunks."""
    if not 0 <= hit_chunks <= len(chunk_token_counts):
        raise InvalidSpecError(f"{hit_chunks} hit chunks out of {len(chunk_token_counts)}")
    return sum(chunk_token_counts[:hit_chunks])


def check_local_tokens(prompt_tokens: int, local_tokens: int, block_tokens: int) -> None:
    """Refuse (``InvalidSpecError``) an engine hit that is not whole blocks of a non-empty prompt."""
    for name, value in (("block_tokens", block_tokens), ("prompt_tokens", prompt_tokens)):
        if not is_int_in(value, 1):
            raise InvalidSpecError(f"{name}: got {value!r}, expected an integer >= 1")
    if not is_int_in(local_tokens, 0) or local_tokens > prompt_tokens or local_tokens % block_tokens:
        raise InvalidSpecError(
            f"local_tokens: got {local_tokens!r}, expected a multiple of block_tokens {block_tokens} "
            f"within the prompt of {prompt_tokens} tokens"
        )


def plan_load(
    *, prompt_tokens: int, local_tokens: int, external_tokens: int, block_tokens: int
) -> LoadSpec | None:
    """The load for one request, or ``None`` when the tier adds nothing to the engine's own hit."""
    check_local_tokens(prompt_tokens, local_tokens, block_tokens)
    if external_tokens < 0:
        raise InvalidSpecError(f"external_tokens must be >= 0, got {external_tokens}")
    stop = min(external_tokens, prompt_tokens - 1)
    if stop <= local_tokens:
        return None
    return LoadSpec(local_tokens, external_tokens, local_tokens, stop, block_tokens)
