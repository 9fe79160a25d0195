"""The model engine's requests: the turns of a chat (``Chat``), each a ``Request`` that waits, loads and
runs (``State``) and carries the chained block hashes the engine keys its prefix cache by; and the
``RequestBook`` of the engine's queues, which moves a request between them."""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence

from attrs import Factory, define, frozen

from kvcore.ids import RequestId

__all__ = ["BLOCK_TOKENS", "Chat", "Request", "RequestBook", "State", "pack"]

BLOCK_TOKENS = 4


class State(enum.Enum):
    WAITING = "waiting"  # queued: new, or preempted and not resumed yet
    LOADING = "loading"  # blocks allocated, kvcore's load not reported yet: the request does not run
    RUNNING = "running"  # prefill or decode


@frozen
class Chat:
    """What the turns of one conversation share: its salt, how the engine looks it up, its length."""

    number: int
    salt: str | None
    by_hashes: bool  # lookups and saves by the engine's block hashes, not by tokens
    turns: int

    @property
    def root(self) -> bytes:
        """The root of the engine's block-hash chain: the salt is in it, as vLLM folds it into the first
        block's hash."""
        return hashlib.sha256(f"root:{self.salt}".encode()).digest()


@define
class Request:
    """One request as the engine sees it; ``blocks`` and what follows belong to its current admission."""

    rid: RequestId
    chat: Chat
    turn: int
    prefix_cache: bool  # whether the engine reads its own prefix cache for it (kvcore then adds more)
    tokens: list[int]
    outputs_left: int
    hashes: list[bytes] = Factory(list)  # chained hash of each full block of ``tokens``
    state: State = State.WAITING
    looked_up: bool = False
    blocks: list[int | None] = Factory(list)  # None: a block out of a sliding window, given back
    computed: int = 0  # tokens whose KV the blocks hold
    epoch: int = 0
    promised: range = range(0)  # request block indices the load covers: what lookup offered
    queued: int = 0  # of them, leading blocks start_load queued (the others must be reported lost)
    errors: set[int] = Factory(set)  # engine blocks take_load_errors named for this load
    load_ops: set[int] = Factory(set)  # this load's ops not reported yet
    gave_up: bool = False  # the load was late: its blocks are recomputed, whatever it reports
    shadowed: int = 0  # leading blocks whose bytes were recorded when handed to save

    def extend_hashes(self) -> None:
        """The engine's chained block hashes (salt in the root), as vLLM keys its prefix cache."""
        while len(self.hashes) < len(self.tokens) // BLOCK_TOKENS:
            j = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else self.chat.root
            block = self.tokens[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS]
            self.hashes.append(hashlib.sha256(parent + pack(block)).digest())

    def needs_block(self) -> bool:
        """Whether its tokens outgrew its blocks: the next token's KV needs another block."""
        return len(self.tokens) > len(self.blocks) * BLOCK_TOKENS


def pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


@define
class RequestBook:
    """The engine's requests by state: ``waiting`` in order, ``running`` (loading or running) in admission
    order, and ``ended``: finished or aborted with "delay", their blocks kept until ``take_finished``
    names them."""

    live: dict[RequestId, Request] = Factory(dict)
    waiting: list[RequestId] = Factory(list)
    running: list[RequestId] = Factory(list)
    ended: dict[RequestId, list[int | None]] = Factory(dict)

    def add(self, req: Request) -> None:
        self.live[req.rid] = req
        self.waiting.append(req.rid)

    def admit(self, req: Request) -> None:
        """Waiting to running: its blocks are allocated."""
        self.waiting.remove(req.rid)
        self.running.append(req.rid)
        req.state = State.RUNNING

    def requeue(self, req: Request) -> None:
        """Preempted: its admission is forgotten, and it is first in line to be admitted again."""
        req.blocks, req.computed, req.shadowed, req.gave_up = [], 0, 0, False
        req.state, req.promised, req.errors, req.load_ops = State.WAITING, range(0), set(), set()
        self.running.remove(req.rid)
        self.waiting.insert(0, req.rid)

    def remove(self, req: Request) -> None:
        """Finished or aborted."""
        del self.live[req.rid]
        (self.waiting if req.state is State.WAITING else self.running).remove(req.rid)

    def owners(self, block: int) -> list[RequestId]:
        """The requests holding an engine block, live or ended."""
        owners = [r for r, req in self.live.items() if block in req.blocks]
        return owners + [r for r, blocks in self.ended.items() if block in blocks]

    def tracked(self) -> int:
        """The requests the scheduler should be tracking: those looked up and not ended, and the ended
        ones not named by ``take_finished`` yet."""
        return sum(1 for req in self.live.values() if req.looked_up) + len(self.ended)
