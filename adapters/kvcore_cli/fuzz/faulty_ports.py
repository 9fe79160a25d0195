"""The ports kvcore is given in a fuzz run, with seeded faults: the ``BlockMover`` over the CPU tier's real
mover and, with ``remote``, the remote tier and the remote index over the in-memory reference store and
index. Jobs fail (wholly or in part) or finish steps late; lookups fail or stall. The remote index holds
its answers' locks for a hand-over (``SupportsHeldLookups``) and keeps the books: every lock taken must
end once, handed over or released, and a hand-over is now and then refused as too old.

``FaultyPorts`` builds them from the seed and answers for them as a whole. The mover and remote classes
keep a leading underscore in their names because a closed one names its class when it refuses a job, and
``kvcore fuzz --verbose`` prints that.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import cast

from kvcore.errors import BackendError, UsageError
from kvcore.execution.cascade_remote import CascadeRemote
from kvcore.execution.remote import StoreRemote
from kvcore.ids import ChunkKey, JobId, LookupId
from kvcore.jobs import JobResult
from kvcore.keying.keys import head_keys
from kvcore.model.head_runs import HeadRuns
from kvcore.ports import (
    BlockMover,
    BlockTransfer,
    Direction,
    HeldChunks,
    RankMemory,
    RemoteTier,
    StoreItem,
    SupportsWriteBack,
)
from kvcore.testing.faults import InjectedFaults
from kvcore.testing.memory import InMemoryChunkIndex, InMemoryChunkStore
from kvcore_cli.fuzz.options import FuzzOptions
from kvcore_cli.fuzz.postponed import INNER_WAIT_S, Fate, Postponed
from kvcore_cli.fuzz.results import FuzzSummary
from kvcore_cli.fuzz.trace import Clock
from kvcore_disk.directory import ChunkDirectory
from kvcore_disk.store import DiskChunkStore

__all__ = ["FaultyPorts", "Spoil"]

Spoil = Callable[[Direction, int, str], None]
"""Leaves garbage in the destination block of a failed copy: an engine block (load) or a host block."""

P_STALL = 0.06  # the remote index answers nothing for 1 to 4 steps
P_LOOKUP_FAIL = 0.1
P_STALE_LOCKS = 0.1  # a hand-over is refused: the locks are too old


class FaultyPorts:
    """The mover, and with ``options.remote`` the remote tier and index, each with its own seeded stream of
    faults (none without ``options.faults``), given to kvcore's composition (``kvcore.plugins.compose``):
    the index at once, the mover as a wrapper of the rank's own (``wrap_mover``), the remote tier over the
    rank's memory (``open_remote``: the store keeps its values in the rank's host pool, as a Mooncake
    client registers it). A failed copy leaves garbage through ``spoil``."""

    def __init__(
        self,
        seed: int,
        options: FuzzOptions,
        clock: Clock,
        spoil: Spoil,
        slot_bytes: int,
        workdir: Path | None = None,
        heads: HeadRuns | None = None,
    ) -> None:
        self._seed = seed
        self._options = options
        self._clock = clock
        self._spoil = spoil
        self._slot_bytes = slot_bytes
        self._workdir = workdir
        self._heads = heads  # the disk tier keeps a value per KV head, as it does in every engine
        self._faults = options.faults
        self._inner_mover: BlockMover | None = None
        self.mover: _FaultyMover | None = None
        self.index: _FaultyIndex | None = None
        self.remote: _FaultyRemote | None = None
        self._inner: RemoteTier | None = None
        if options.remote or options.disk or options.stack:
            index_rng = random.Random(f"kvcore-fuzz:{seed}:index")
            self.index = _FaultyIndex(InMemoryChunkIndex(), index_rng, options.faults)

    def wrap_mover(self, mover: BlockMover) -> BlockMover:
        """The rank's mover, with faults (``kvcore.plugins.MoverWrap``)."""
        rng = random.Random(f"kvcore-fuzz:{self._seed}:mover")
        self._inner_mover = mover
        self.mover = _FaultyMover(mover, self._clock, rng, self._faults, self._spoil)
        return self.mover

    def open_remote(self, memory: RankMemory) -> RemoteTier | None:
        """The rank's remote tier over its host pool, with faults (``kvcore.plugins.RemoteOpener``)."""
        options, index = self._options, self.index
        if index is None:
            return None
        if memory.host is None:
            raise UsageError("the fuzzer's remote tier needs the rank's host pool")
        # a memoryview slices and assigns as the bytearray it is annotated with does
        view = cast(bytearray, memory.host)
        capacity = 4 * options.pool_slots * self._slot_bytes
        remote: RemoteTier
        if options.disk or options.stack:
            if self._workdir is None:
                raise UsageError("workdir: a directory for the disk tier's files, with the disk option")
            hooks = InjectedFaults()
            # room for the same values as the in-memory store's, and their files' headers
            directory = ChunkDirectory.open(self._workdir, self.disk_bytes)
            disk = StoreRemote(
                DiskChunkStore(directory, memoryview(view), io_threads=1, faults=hooks), self._heads
            )
            fail_next = hooks.fail_next
            # a stack: the disk, then a smaller in-memory store behind it (its own evictions)
            behind = StoreRemote(InMemoryChunkStore(view, capacity=capacity // 2))
            back = options.write_back
            if options.stack:
                remote = CascadeRemote([disk, behind], (1, 1), (back, False))
            else:
                remote = CascadeRemote([disk], (1,), (True,)) if back else disk
        else:
            store = InMemoryChunkStore(view, capacity=capacity)
            remote, fail_next = StoreRemote(store), store.fail_next
        rng = random.Random(f"kvcore-fuzz:{self._seed}:remote")
        split = self.per_head == (True,)  # the scheduler asks the index for each head's key
        self.remote = _FaultyRemote(remote, fail_next, index.inner, self._clock, rng, options.faults, split)
        self._inner = remote
        return self.remote

    @property
    def per_head(self) -> tuple[bool, ...]:
        """Which remote tiers keep a value per KV head, as the scheduler is told (``open_scheduler``): the
        disk tier does, as in every engine; the in-memory store keeps a value per rank."""
        if self._heads is None or not (self._options.remote or self._options.disk or self._options.stack):
            return ()
        if self._options.stack:
            return (True, False)
        return (self._options.disk,)

    @property
    def disk_bytes(self) -> int:
        """The disk tier's size: room for the in-memory store's values, and their files' headers (one per
        KV head of each chunk)."""
        return 4 * self._options.pool_slots * (self._slot_bytes + 4 * 256)

    def close(self) -> None:
        """Close the remote tier (its stores' threads end) and the rank's own mover, which the worker's
        close leaves open (a halt closes the faulty mover only, and reopens it); every job is reported by
        now."""
        if self._inner is not None:
            self._inner.close()
        if self._inner_mover is not None:
            self._inner_mover.close()

    def weather(self, rng: random.Random) -> None:
        """The remote index stalls for a few steps, or fails its next answer, as the engine's ``rng``
        decides."""
        index = self.index
        if index is None or not self._faults:
            return
        step = self._clock.step
        if index.stalled and step >= index.stall_until:
            index.resume()
        if not index.stalled and rng.random() < P_STALL:
            index.stall(until=step + rng.randint(1, 4))
        if rng.random() < P_LOOKUP_FAIL:
            index.inject_failure()

    def resume(self) -> None:
        """End a stall of the remote index."""
        if self.index is not None:
            self.index.resume()

    def held(self) -> int:
        """Jobs held for a later step."""
        return (self.mover.held() if self.mover else 0) + (self.remote.held() if self.remote else 0)

    def count(self, summary: FuzzSummary) -> None:
        """Put the faults injected, and the step the mover was closed at, into ``summary``."""
        summary.mover_faults = self.mover.failed if self.mover else 0
        summary.remote_faults = self.remote.failed if self.remote else 0
        summary.late_jobs = (self.mover.late if self.mover else 0) + (self.remote.late if self.remote else 0)
        summary.lookup_faults = self.index.failures if self.index else 0
        summary.index_stalls = self.index.stalls if self.index else 0
        summary.locks_handed_over = self.index.handed if self.index else 0
        summary.halts = tuple(self.mover.halts) if self.mover else ()


class _FaultyMover(Postponed):
    """The ``BlockMover`` port over the real mover, with seeded fates: a failed copy also leaves garbage in
    its destination blocks (``spoil``), as the port allows.

    Transfers the real mover refuses are kept in ``refused``: the engine never hands kvcore bad block ids,
    so each is a copy kvcore planned wrongly (a destination twice, a block out of range). A worker that
    halts closes it (the jobs it holds fail; ``halts`` records the steps) and reopens it when it resumes:
    the real mover under it runs each job to its end when the job's step comes, so none is left running.
    """

    def __init__(
        self, inner: BlockMover, clock: Clock, rng: random.Random, chaos: bool, spoil: Spoil
    ) -> None:
        super().__init__(clock, rng, chaos)
        self._inner = inner
        self._spoil = spoil
        self.refused: list[str] = []
        self.halts: list[int] = []

    def close(self) -> None:
        if self.closed_at is None:
            self.halts.append(self._clock.step)
        super().close()

    def reopen(self) -> bool:
        self.closed_at = None
        return True

    def submit(self, transfer: BlockTransfer) -> JobId:
        size = len(transfer.engine_blocks)
        fate = self._fate(size)
        spoilt = tuple(sorted(self._rng.sample(range(size), fate.failing)))
        return self._hold(fate, size, partial(self._run, transfer, spoilt))

    def _run(self, transfer: BlockTransfer, spoilt: tuple[int, ...], job: JobId) -> JobResult:
        size = len(transfer.engine_blocks)
        try:
            inner = self._inner.submit(transfer)
        except UsageError as exc:
            self.refused.append(f"{_describe(transfer)}: {exc}")
            return JobResult(job, tuple(range(size)), str(exc))
        (result,) = self._inner.wait([inner], INNER_WAIT_S)
        load = transfer.direction is Direction.LOAD
        for i in spoilt:
            block = transfer.engine_blocks[i] if load else transfer.host_blocks[i]
            self._spoil(transfer.direction, block, f"garbage of failed {transfer.direction.value} job {job}")
        whole = len(spoilt) == size and size > 0
        error = result.error or ("injected: the copy failed" if whole else None)
        return JobResult(job, tuple(sorted({*result.failed, *spoilt})), error)


class _FaultyRemote(Postponed):
    """The remote tier (the in-memory reference store, the disk tier's store, or a cascade of the two) with
    seeded fates: items fail through ``fail_next`` (the store's own, or the disk's fault hooks). A publish
    registers the keys it stored in the remote index, as a store's metadata service would; the index is
    not told of evictions, so it may promise a chunk the store lost (the fetch then misses)."""

    def __init__(
        self,
        remote: RemoteTier,
        fail_next: Callable[[int], None],
        index: InMemoryChunkIndex,
        clock: Clock,
        rng: random.Random,
        chaos: bool,
        split: bool,
    ) -> None:
        super().__init__(clock, rng, chaos)
        self._fail_next = fail_next
        self._index = index
        self._remote = remote
        self._split = split  # register each head's key of a published chunk, as the index is asked

    def submit_fetch(self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()) -> JobId:
        return self._submit(self._remote.submit_fetch, session, items, chain, publish=False)

    def submit_publish(
        self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        return self._submit(self._remote.submit_publish, session, items, chain, publish=True)

    @property
    def writes_back(self) -> bool:
        """Whether the tier beneath writes a tier back (``SupportsWriteBack``): the worker then tracks its
        dirty slots and writes them back, through these fates too."""
        return isinstance(self._remote, SupportsWriteBack) and self._remote.writes_back

    def submit_write_back(self, session: str, items: Sequence[StoreItem]) -> JobId:
        remote = self._remote
        if not isinstance(remote, SupportsWriteBack):
            raise UsageError(f"{type(remote).__name__} has no tier written back")
        return self._submit(lambda s, i, _: remote.submit_write_back(s, i), session, items, (), publish=True)

    def adopt(self, session: str, holder: str, chain: Sequence[ChunkKey], start: int, end: int) -> None:
        self._remote.adopt(session, holder, chain, start, end)

    def end_session(self, session: str) -> None:
        self._remote.end_session(session)

    def _submit(
        self,
        submit: Callable[[str, Sequence[StoreItem], Sequence[ChunkKey]], JobId],
        session: str,
        items: Sequence[StoreItem],
        chain: Sequence[ChunkKey],
        *,
        publish: bool,
    ) -> JobId:
        fate = self._fate(len(items))
        work = partial(self._run, submit, session, tuple(items), tuple(chain), fate, publish)
        return self._hold(fate, len(items), work)

    def _run(
        self,
        submit: Callable[[str, Sequence[StoreItem], Sequence[ChunkKey]], JobId],
        session: str,
        items: tuple[StoreItem, ...],
        chain: tuple[ChunkKey, ...],
        fate: Fate,
        publish: bool,
        job: JobId,
    ) -> JobResult:
        if fate.failing:
            self._fail_next(fate.failing)
        (result,) = self._remote.wait([submit(session, items, chain)], INNER_WAIT_S)
        if publish:
            stored = [item.key for i, item in enumerate(items) if i not in result.failed]
            self._index.add([head for key in stored for head in head_keys(key)] if self._split else stored)
        return JobResult(job, result.failed, result.error)


class _FaultyIndex:
    """The remote index the scheduler asks: the in-memory reference, stalling while told to, and failing
    through its own ``fail_next`` but never twice in a row. Three failures in a row open the lookup's
    circuit breaker, whose back-off is wall-clock time: the run would then depend on the machine's speed."""

    def __init__(self, inner: InMemoryChunkIndex, rng: random.Random, faults: bool) -> None:
        self.inner = inner
        self._rng = rng
        self._faults = faults
        self._holding: dict[LookupId, tuple[int, int]] = {}  # held lookups: (first chunk, ranks)
        self._answered: dict[LookupId, HeldChunks] = {}
        self.open: set[HeldChunks] = set()  # taken, not yet handed over or released
        self.ended_twice: list[HeldChunks] = []
        self.handed = 0
        self.failures = 0
        self.stalls = 0
        self.stall_until = 0
        self._stall: contextlib.ExitStack | None = None
        self._armed = False
        self._in_a_row = 0

    @property
    def stalled(self) -> bool:
        return self._stall is not None

    def stall(self, until: int) -> None:
        """Answer no lookup until ``resume``, which the weather calls at step ``until``."""
        self._stall = contextlib.ExitStack()
        self._stall.enter_context(self.inner.stall())
        self.stall_until = until
        self.stalls += 1

    def resume(self) -> None:
        if self._stall is not None:
            self._stall.close()
            self._stall = None

    def inject_failure(self) -> None:
        """Make the next answered lookup fail, unless the last one failed or a failure is pending."""
        if not self._armed and not self._in_a_row:
            self.inner.fail_next(1)
            self._armed = True

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        return self.inner.submit_lookup(chunks, preceding)

    def submit_held_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        lookup_id = self.inner.submit_lookup(chunks, preceding)
        self._holding[lookup_id] = (len(preceding), len(chunks[0]) if chunks else 1)
        return lookup_id

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        try:
            answer = self.inner.poll_lookup(lookup_id)
        except BackendError:
            self._holding.pop(lookup_id, None)
            self._armed = False
            self._in_a_row += 1
            self.failures += 1
            raise
        if answer is not None:
            self._in_a_row = 0
            held = self._holding.pop(lookup_id, None)
            if held is not None and answer:
                first, ranks = held
                holders = tuple(f"lookup{lookup_id}.rank{rank}" for rank in range(ranks))
                self._answered[lookup_id] = HeldChunks(holders, first, first + answer)
        return answer

    def take_held(self, lookup_id: LookupId) -> HeldChunks | None:
        held = self._answered.pop(lookup_id, None)
        if held is not None:
            self.open.add(held)
        return held

    def hand_over(self, held: HeldChunks) -> bool:
        self._end(held)
        if self._faults and self._rng.random() < P_STALE_LOCKS:
            return False
        self.handed += 1
        return True

    def release_held(self, held: HeldChunks) -> None:
        self._end(held)

    @property
    def untaken(self) -> int:
        """Held lookups answered whose locks the scheduler never took."""
        return len(self._answered)

    def _end(self, held: HeldChunks) -> None:
        if held in self.open:
            self.open.remove(held)
        else:
            self.ended_twice.append(held)

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        self._holding.pop(lookup_id, None)
        self._answered.pop(lookup_id, None)
        self.inner.cancel_lookup(lookup_id)

    def close(self) -> None:
        self.resume()
        self.inner.close()


def _describe(transfer: BlockTransfer) -> str:
    return f"{transfer.direction.value} e{list(transfer.engine_blocks)} h{list(transfer.host_blocks)}"
