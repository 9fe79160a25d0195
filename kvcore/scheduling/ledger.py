"""The ops in flight: which ops the workers are running, what each holds, and when every rank is done.

An op is done once every rank reported it, and failed (in the blocks any rank failed) if any rank failed.
Each op remembers what its completion must release: the keys it pinned or is storing, the chunks it
fetched from a remote tier, the reset epoch it was submitted in (a load older than a reset fails), and
whether its request was preempted since (its blocks are no longer the request's: it was fenced).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from kvcore.ids import ChunkKey, RequestId
from kvcore.model.step import BlockOp, OpReport

__all__ = ["InFlightOp", "OpLedger"]


class InFlightOp:
    """One op until every rank reported it."""

    __slots__ = (
        "epoch",
        "failed",
        "fenced",
        "fetched",
        "keys",
        "op",
        "placed",
        "ranks",
        "request_id",
        "sizes",
        "suspect",
    )

    def __init__(
        self,
        request_id: RequestId,
        op: BlockOp,
        keys: tuple[ChunkKey, ...],
        sizes: tuple[int, ...],
        epoch: int,
        fetched: frozenset[ChunkKey],
    ) -> None:
        self.request_id = request_id
        self.op = op
        self.keys = keys
        self.sizes = sizes  # the op's blocks of each key, in order
        self.epoch = epoch
        self.fetched = fetched  # a load's chunks fetched from the remote tier (the others are pinned)
        self.ranks: set[int] = set()
        self.placed: dict[int, tuple[tuple[int, ...], ...]] = {}  # rank -> its ``OpReport.placed``
        self.failed: set[int] = set()
        self.suspect = False  # a rank's failure may mean bad chunk bytes (not a refusal or a fence)
        self.fenced = False

    def remote_keys(self) -> tuple[ChunkKey, ...]:
        """The key of each of the op's ``remote`` chunks, in order: a write-back's are its keys, another
        op's the keys whose blocks each remote chunk starts at."""
        if self.op.write_back:
            return self.keys
        first_block: dict[int, ChunkKey] = {}
        start = 0
        for key, size in zip(self.keys, self.sizes, strict=True):
            first_block[start] = key
            start += size
        return tuple(first_block[chunk.first] for chunk in self.op.remote)

    def tiers_holding(self) -> dict[int, list[ChunkKey]]:
        """The remote tiers (0: the first behind the pool) that now hold every shard of some of the op's
        chunks, each with those chunks' keys: a shard is held where its writing rank said it stored it."""
        held: dict[int, list[ChunkKey]] = {}
        if not self.placed:
            return held
        for i, (key, chunk) in enumerate(zip(self.remote_keys(), self.op.remote, strict=True)):
            writers = [rank for rank, shard in enumerate(chunk.keys) if shard is not None]
            tiers: set[int] | None = None
            for rank in writers:
                placed = self.placed.get(rank, ())
                mine = set(placed[i]) if i < len(placed) else set()
                tiers = mine if tiers is None else tiers & mine
            for tier in sorted(tiers or ()):
                held.setdefault(tier, []).append(key)
        return held

    def failed_chunks(self) -> tuple[ChunkKey, ...]:
        """Keys of the op's chunks holding a failed block (the op's blocks run chunk after chunk)."""
        if not self.failed:
            return ()
        out, start = [], 0
        for key, size in zip(self.keys, self.sizes, strict=True):
            if any(start <= i < start + size for i in self.failed):
                out.append(key)
            start += size
        return tuple(out)


class OpLedger:
    """Every op in flight, by id, for an engine of ``world_size`` ranks."""

    def __init__(self, world_size: int) -> None:
        self._world_size = world_size
        self._ids = itertools.count(1)
        self._ops: dict[int, InFlightOp] = {}

    def __len__(self) -> int:
        return len(self._ops)

    def __iter__(self) -> Iterator[InFlightOp]:
        return iter(self._ops.values())

    def next_id(self) -> int:
        return next(self._ids)

    def add(
        self,
        request_id: RequestId,
        op: BlockOp,
        keys: tuple[ChunkKey, ...],
        sizes: Sequence[int],
        epoch: int,
        fetched: frozenset[ChunkKey] = frozenset(),
    ) -> None:
        self._ops[op.op_id] = InFlightOp(request_id, op, keys, tuple(sizes), epoch, fetched)

    def report(self, report: OpReport) -> InFlightOp | None:
        """Account one rank's report; the op once every rank reported it (it leaves the ledger), else
        ``None``. Unknown ops and a rank's second report are ignored."""
        entry = self._ops.get(report.op_id)
        if entry is None or report.rank in entry.ranks:
            return None
        entry.ranks.add(report.rank)
        entry.failed.update(report.failed)
        if report.placed:
            entry.placed[report.rank] = report.placed
        entry.suspect |= bool(report.failed) and not report.chunks_intact
        if len(entry.ranks) < self._world_size:
            return None
        return self._ops.pop(report.op_id)

    def fence(self, request_id: RequestId) -> list[int]:
        """Mark the request's ops fenced (its blocks are no longer its own); returns those newly marked."""
        fenced = []
        for op_id, entry in self._ops.items():
            if entry.request_id == request_id and not entry.fenced:
                entry.fenced = True
                fenced.append(op_id)
        return fenced
