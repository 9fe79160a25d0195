"""One op on its way through a worker (``Run``): its stages (``Stage``: fetch, copy, publish), the job
queue each stage's job is on (``Queue``), and the items a remote job names (``Items``)."""

from __future__ import annotations

import enum

from kvcore.errors import BackendError, UsageError
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobResult
from kvcore.model.step import BlockOp, RemoteChunk
from kvcore.ports import BlockItem, BlockRemote, RemoteTier, StoreItem, SupportsWriteBack

__all__ = ["Items", "Queue", "Run", "Stage", "tier_moves_blocks"]


class Stage(enum.Enum):
    """Where a run is: fetching its remote chunks into host slots (a load), copying blocks between the
    engine and host slots, publishing its chunks from host slots to the remote tier (a save)."""

    FETCH = "fetch"
    COPY = "copy"
    PUBLISH = "publish"


class Queue(enum.Enum):
    """Which of the worker's two job queues a run's current job is on."""

    MOVER = "mover"
    REMOTE = "remote tier"


class Run:
    """One op on its way through its stages."""

    __slots__ = (
        "abandoned",
        "chain",
        "copied",
        "error",
        "failed",
        "op",
        "placed",
        "refused",
        "stage",
        "staged",
    )

    def __init__(self, op: BlockOp, chain: tuple[ChunkKey, ...]) -> None:
        self.op = op
        # its request's chain as the op was started: a later op may replace the tail at its end
        self.chain = chain
        self.abandoned = False  # fenced: its engine blocks are no longer the request's
        self.refused = False  # refused before any byte moved (bad input, not bad chunks)
        self.stage = Stage.COPY
        self.failed: set[int] = set()  # the op's block indices whose copy failed or never ran
        self.error: str | None = None
        self.staged: tuple[RemoteChunk, ...] = ()  # the chunks of the current remote job, in item order
        self.placed: dict[int, tuple[int, ...]] = {}  # published chunk (index in op.remote) -> its tiers
        self.copied: tuple[int, ...] = ()  # the op's block indices in the mover job, in its order

    def fail_chunks(self, chunks: tuple[RemoteChunk, ...] | list[RemoteChunk]) -> None:
        """The blocks of these chunks hold no KV of the request (their fetch or publish failed)."""
        for chunk in chunks:
            self.failed.update(range(chunk.first, chunk.first + chunk.count))

    def place(self, result: JobResult, failed: set[int]) -> None:
        """Record the tiers that stored each chunk of a finished publish of ``staged`` (``failed``: its
        indices among them that no tier stored; one tier: the others are in it)."""
        position = {chunk.first: i for i, chunk in enumerate(self.op.remote)}
        for j, chunk in enumerate(self.staged):
            if result.placed and j < len(result.placed):
                tiers = result.placed[j] if j not in failed else ()
            else:
                tiers = () if j in failed else (0,)
            self.placed[position[chunk.first]] = tiers


def tier_moves_blocks(op: BlockOp) -> bool:
    """Whether the remote tier moves the op's blocks itself (its chunks have no host slot: a tier without
    a pool in front, ``BlockRemote``)."""
    return bool(op.remote) and op.remote[0].slot is None


class Items:
    """One rank's remote jobs: their items (a chunk's host slot as a ``StoreItem``, a tail's leading
    blocks of it; or its engine blocks as a ``BlockItem``), and their submission."""

    def __init__(self, rank: int, slot_bytes: int, slot_blocks: int) -> None:
        self._rank = rank
        self._slot_bytes = slot_bytes
        self._slot_blocks = slot_blocks

    def store_item(self, chunk: RemoteChunk) -> StoreItem:
        key, slot, blocks = chunk.keys[self._rank], chunk.slot, chunk.value_blocks
        if key is None or slot is None:
            raise UsageError(f"chunk {chunk} has no key for rank {self._rank} or no host slot")
        if blocks is not None and blocks >= self._slot_blocks:
            raise UsageError(f"chunk {chunk}: a tail of {blocks} blocks, slots hold {self._slot_blocks}")
        length = self._slot_bytes if blocks is None else self._slot_bytes // self._slot_blocks * blocks
        return StoreItem(key, slot * self._slot_bytes, length)

    def block_item(self, op: BlockOp, chunk: RemoteChunk) -> BlockItem:
        key = chunk.keys[self._rank]
        if key is None:
            raise UsageError(f"chunk {chunk} has no key for rank {self._rank}")
        blocks = op.engine_blocks[chunk.first : chunk.first + chunk.count]
        return BlockItem(key, blocks, chunk.from_block, chunk.value_blocks)

    def submit(self, remote: RemoteTier | None, run: Run, stage: Stage, *, blocks: bool) -> JobId:
        """Submit the job of ``run``'s ``staged`` chunks at ``stage`` (a fetch, a publish, a write-back),
        as engine blocks the tier moves itself where ``blocks``. Raises ``BackendError`` or ``UsageError``
        where the tier refuses it or cannot do it (nothing submitted)."""
        if remote is None:
            raise UsageError("no remote tier attached")
        op, fetch = run.op, stage is Stage.FETCH
        if blocks:
            if not isinstance(remote, BlockRemote):
                raise BackendError(f"{type(remote).__name__} cannot move engine blocks itself")
            moved = [self.block_item(op, c) for c in run.staged]
            submit_blocks = remote.submit_fetch_blocks if fetch else remote.submit_publish_blocks
            return submit_blocks(op.request_id, moved, run.chain)
        items = [self.store_item(c) for c in run.staged]
        if op.write_back:
            if not isinstance(remote, SupportsWriteBack):
                raise UsageError(f"{type(remote).__name__} has no tier written back")
            return remote.submit_write_back(op.request_id, items)
        submit = remote.submit_fetch if fetch else remote.submit_publish
        return submit(op.request_id, items, run.chain)
