"""The model engine's KV memory: its blocks, a free list, reference counts, its prefix cache, and the token
slots each block it relies on must hold (the checks compare the blocks with them after every step)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvcore_cli.fuzz.oracle import Bytes, KVOracle
from kvcore_cli.fuzz.requests import BLOCK_TOKENS, Request

__all__ = ["EngineMemory", "held"]


def held(req: Request, j: int) -> int:
    """The engine block of the request's block ``j``, which the engine must hold (not given back)."""
    block = req.blocks[j]
    if block is None:
        raise AssertionError(f"{req.rid}: block {j} was given back (out of its window) and is used again")
    return block


class EngineMemory:
    """``kv`` is the engine's KV, ``[layer, block, head, token slot, K and V bytes]``. A block freed goes to
    the back of the free list (least recently freed first), or to the front when its request was
    preempted; it stays in the prefix cache until it is taken again.

    ``on_take`` is called with a block given back while its request ran (a sliding window) just before it
    is handed out again (and overwritten): copies that may still read it must be fenced first (kvcore
    fences the copies of preempted requests itself)."""

    def __init__(self, kv: Bytes, oracle: KVOracle) -> None:
        self.kv = kv
        self._oracle = oracle
        self.on_take: Callable[[int], None] = lambda block: None
        self._given_back: set[int] = set()
        blocks = kv.shape[1]
        self.free: deque[int] = deque(range(blocks))
        self.refs = [0] * blocks
        self.cached: dict[bytes, int] = {}  # block hash -> the block holding it
        self.hash_of: dict[int, bytes] = {}
        self.expect: dict[int, Bytes] = {}  # block -> the token slots it must hold now

    def prefix_hits(self, req: Request) -> int:
        """Leading full blocks the engine's prefix cache holds (never the whole prompt: one token is
        always computed, for the logits)."""
        hits = 0
        while (
            req.prefix_cache
            and hits < (len(req.tokens) - 1) // BLOCK_TOKENS
            and req.hashes[hits] in self.cached
        ):
            hits += 1
        return hits

    def allocate(self, req: Request, hits: int, step: int) -> list[int | None] | None:
        """The blocks of an admission: the ``hits`` leading blocks shared from the prefix cache and fresh
        ones for the rest of the prompt; ``None`` (and nothing taken) when too few blocks are free."""
        shared = [self.cached[req.hashes[j]] for j in range(hits)]
        need = -(-len(req.tokens) // BLOCK_TOKENS) - hits
        if need > len(self.free) - sum(1 for b in shared if not self.refs[b]):
            return None
        for block in shared:
            if not self.refs[block]:
                self.free.remove(block)
            self.refs[block] += 1
        return [*shared, *(self.take(req.rid, step) for _ in range(need))]

    def take(self, rid: str, step: int) -> int:
        """A block off the free list, dropped from the prefix cache and filled with recognisable poison."""
        block = self.free.popleft()
        if block in self._given_back:
            self._given_back.discard(block)
            self.on_take(block)
        cached = self.hash_of.pop(block, None)
        if cached is not None:
            del self.cached[cached]
        self.refs[block] = 1
        self.expect.pop(block, None)
        self._oracle.scribble(
            self.kv[:, block], f"poison of engine block {block} given to {rid} at step {step}"
        )
        return block

    def release(self, blocks: Sequence[int | None], *, front: bool = False) -> None:
        for block in blocks:
            if block is None:
                continue
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            if block not in self.hash_of:
                self.expect.pop(block, None)  # not in the prefix cache: its bytes no longer matter
            if front:
                self.free.appendleft(block)
            else:
                self.free.append(block)

    def give_back_before(self, req: Request, first: int) -> int:
        """A sliding window: the request no longer needs its blocks before block ``first``: given back
        (``None`` in its table), as vLLM frees the blocks that fell out of a window; returns how many."""
        gone = req.blocks[: max(first, 0)]
        self.release(gone)
        self._given_back.update(block for block in gone if block is not None)
        req.blocks[: len(gone)] = [None] * len(gone)
        return sum(1 for block in gone if block is not None)

    def in_use(self) -> int:
        return sum(1 for r in self.refs if r)

    def compute(self, req: Request, upto: int) -> None:
        """The forward pass writes the KV of tokens ``[computed, upto)``: their token slots, nothing else."""
        for j in range(req.computed // BLOCK_TOKENS, -(-upto // BLOCK_TOKENS)):
            slots = self.record(req, j, min(upto, (j + 1) * BLOCK_TOKENS))
            first = max(req.computed - j * BLOCK_TOKENS, 0)
            self.kv[:, held(req, j), :, first : slots.shape[2]] = slots[:, :, first:]
        req.computed = upto

    def record(self, req: Request, j: int, upto: int) -> Bytes:
        """Block ``j`` of the request holds the KV of its tokens before ``upto`` from now on (what its other
        slots hold does not matter); a full block enters the prefix cache."""
        slots = self._oracle.slots(req, j, upto)
        block = held(req, j)
        self.expect[block] = slots
        if upto == (j + 1) * BLOCK_TOKENS and req.hashes[j] not in self.cached and block not in self.hash_of:
            self.cached[req.hashes[j]] = block
            self.hash_of[block] = req.hashes[j]
        return slots

    def new_epoch(self) -> None:
        """After a reset the prefix cache holds KV of the old weights: it is emptied, and only blocks still
        held must keep their bytes."""
        self.cached.clear()
        for block in self.hash_of:
            if not self.refs[block]:
                self.expect.pop(block, None)
        self.hash_of.clear()
