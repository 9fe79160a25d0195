"""``BlockWorker``: the worker side for any engine. It executes the scheduler's block ops through a
``BlockMover``, and through a remote tier when one is attached.

Workers own memory and execute; they decide nothing (docs/architecture.md, "Where things run"). An op
is one mover job, preceded by a fetch (a load of chunks the remote tier holds) or followed by a publish (a
save to the remote tier); a write-back op is a publish alone (pool chunks to the tiers written back). An
op whose chunks have no host slot is one remote job instead: the remote tier moves the engine blocks
itself (``BlockRemote``). Every op is reported exactly once, failures included — a copy the mover refused
is reported as failed at once — so the scheduler never waits for an op that will not come. An op's way
through its stages is a ``Run`` (``runs``); the rank's sessions on the remote tier are ``sessions``, its
dirty slots ``dirty``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable

from kvcore.errors import BackendError, TransferTimeout, UsageError
from kvcore.execution.dirty import DirtySlots
from kvcore.execution.runs import Items, Queue, Run, Stage, tier_moves_blocks
from kvcore.execution.sessions import Sessions
from kvcore.ids import JobId
from kvcore.jobs import JobResult
from kvcore.kit.closing import close_quietly
from kvcore.kit.repeats import RepeatedWarnings
from kvcore.model.step import OpReport, RemoteChunk, StepPlan
from kvcore.ports import (
    BlockMover,
    BlockRemote,
    BlockTransfer,
    Direction,
    JobQueue,
    RemoteTier,
    SupportsDeviceOrder,
    SupportsReopen,
    SupportsWriteBack,
)

__all__ = ["FLUSH_TIMEOUT_S", "BlockWorker"]

FLUSH_TIMEOUT_S = 30.0
"""How long ``BlockWorker.close`` gives the chunks not yet written back to reach the tiers written back."""

log = logging.getLogger(__name__)


class BlockWorker:
    """One rank's executor of ``StepPlan``s.

    ``remote`` attaches a remote tier whose values are one host slot (``slot_bytes``, ``slot_blocks``
    host blocks) of this rank each, or a tail's leading blocks of one; ops without remote chunks never
    touch it. With it, the worker keeps each request's chain (this rank's keys from the request's first
    chunk on, pieced together from the ops' ``chain`` deltas) until the request's session ends, and
    names it in every fetch and publish, as a chained tier needs. ``mover`` is ``None`` for a worker with
    no host slots: the remote tier moves every op's blocks itself.

    With tiers written back (``SupportsWriteBack``), the worker also knows which of its slots hold
    chunks saved but not yet written back (a write-back, or a later op that writes the slot, ends that),
    and ``close`` writes them back before anything closes: the pool's last chunks survive a restart.
    """

    def __init__(
        self,
        mover: BlockMover | None,
        rank: int = 0,
        remote: RemoteTier | None = None,
        slot_bytes: int = 0,
        *,
        slot_blocks: int = 0,
        fence_timeout: float = 30.0,
    ) -> None:
        if mover is None and remote is None:
            raise UsageError("a worker needs a mover, a remote tier or both")
        if mover is not None and remote is not None:
            if slot_bytes <= 0:
                raise UsageError("a remote tier needs the host slot size (slot_bytes > 0)")
            if slot_blocks < 1 or slot_bytes % slot_blocks:
                raise UsageError(f"slot_blocks: got {slot_blocks!r}, expected a divisor of {slot_bytes}")
        if not 0 < fence_timeout < float("inf"):
            raise UsageError(f"fence_timeout: got {fence_timeout!r}, expected a finite number of seconds > 0")
        self._fence_timeout = fence_timeout
        self._halted = False
        self._closed = False
        self._warnings = RepeatedWarnings(log)
        self._mover = mover
        self._rank = rank
        self._remote = remote
        self._items = Items(rank, slot_bytes, slot_blocks)
        self._sessions = Sessions(rank, remote)
        self._runs: dict[int, Run] = {}  # op id -> run, until reported
        self._jobs: dict[tuple[Queue, JobId], int] = {}  # (queue, job) -> op id
        self._current: dict[int, tuple[Queue, JobId]] = {}  # op id -> its job in flight
        self._ready: list[OpReport] = []
        writes_back = isinstance(remote, SupportsWriteBack) and remote.writes_back
        self._dirty = DirtySlots(slot_blocks) if writes_back else None

    def execute(self, plan: StepPlan) -> None:
        """Fence the plan's ``fenced`` ops, then start every op of the plan; returns at once (unless a
        fenced load is still copying into engine blocks: that copy is waited for, see ``fence``)."""
        fenced = set(plan.fenced)
        if fenced:
            self.fence(fenced)
        for op in plan.ops:
            if self._dirty:
                self._dirty.overwritten(op)
            self._sessions.extend(op)
            if op.held is not None:
                self._sessions.adopt(op, op.held)
            run = Run(op, self._sessions.chain_of(op.request_id) if op.remote else ())
            self._runs[op.op_id] = run
            if op.op_id in fenced:  # its blocks were freed before it could start: it moves nothing
                run.abandoned = True
                run.failed.update(range(len(op.engine_blocks)))
                self._done(run)
                continue
            if op.write_back:  # the pool's slots to the tiers written back: no engine block
                self._start_remote(run, Stage.PUBLISH, op.remote)
                continue
            if tier_moves_blocks(op):
                self._start_remote(run, Stage.FETCH if op.direction is Direction.LOAD else Stage.PUBLISH)
                continue
            if op.direction is Direction.LOAD and op.remote:
                if self._remote is not None:
                    self._start_remote(run, Stage.FETCH, op.remote)
                    continue
                log.warning("kvcore: op %d needs a remote tier this worker lacks", op.op_id)
                run.fail_chunks(op.remote)  # their slots hold no fetched bytes
            self._start_copy(run)
        for request_id in plan.ended:
            self._sessions.ended(request_id, busy=self._busy(request_id))

    def fence(self, op_ids: Collection[int], timeout: float | None = None) -> None:
        """The engine no longer holds these ops' blocks for their request (freed, maybe reused already):
        from now on no copy of theirs may read or write those blocks on the request's behalf.

        ``abandon`` says what stops at once; a copy already running into engine blocks is then waited for
        (at most ``timeout``, default the worker's ``fence_timeout``); one still running after that halts
        the whole worker (``halt``, until ``resume``), as nothing else can keep it from writing blocks
        that now hold other KV.
        """
        writing = self.abandon(op_ids)
        if not writing:
            return
        done = self.wait(writing, self._fence_timeout if timeout is None else timeout)
        self._ready.extend(done)  # after the wait, which takes (and so replaces) the ready list
        late = [op_id for op_id in writing if op_id in self._current]
        if late:
            log.error("kvcore: loads %s into freed blocks still copying after the fence; halting", late)
            self.halt()

    def abandon(self, op_ids: Collection[int]) -> list[int]:
        """Give up these ops without waiting; returns the loads whose copy into engine blocks may still be
        running (the engine must not reuse their blocks before they are reported).

        A save whose copy has not finished by now reads bytes that are not the request's KV: it keeps and
        publishes nothing. A load moves nothing more: a fetch still running is not followed by its copy,
        and a remote tier that moves engine blocks itself starts no copy more (its copy already running
        is the one to wait for). Abandoned ops are still reported, failed, once their current job ends;
        unknown or reported ops are ignored.
        """
        writing: list[int] = []
        for op_id in op_ids:
            run = self._runs.get(op_id)
            if run is None or run.abandoned:
                continue
            save = run.op.direction is Direction.SAVE
            if save and run.stage is Stage.PUBLISH and not tier_moves_blocks(run.op):
                continue  # its copy into the host slot finished before now: the bytes are the KV
            run.abandoned = True
            run.failed.update(range(len(run.op.engine_blocks)))
            current = self._current.get(op_id)
            if current is None:
                continue
            tier = self._remote if current[0] is Queue.REMOTE else None
            remote = tier if isinstance(tier, BlockRemote) else None  # a tier that can give a job up
            if save:
                if remote is not None:
                    remote.abandon(current[1])
            else:
                copying = run.stage is Stage.COPY  # a copy from the host slot: queued or running
                moved_by_tier = tier_moves_blocks(run.op) and (remote is None or remote.abandon(current[1]))
                if copying or moved_by_tier:
                    writing.append(op_id)
        return writing

    def halt(self) -> None:
        """Stop every copy that could still write engine blocks (joining its thread): the mover's, or,
        with no mover, the remote tier's, which then moves blocks itself. Jobs not yet run fail; later
        ops fail (cache misses) until ``resume``; ``halted`` says so meanwhile."""
        self._halted = True
        close_quietly(self._mover if self._mover is not None else self._remote)

    @property
    def halted(self) -> bool:
        """Whether ``halt`` stopped this worker's copies (and ``resume`` has not yet restarted them):
        every op fails meanwhile."""
        return self._halted

    def resume(self) -> bool:
        """After ``halt``: copy again, on the same host slots, once every copy of the halted mover and
        every job in which the remote tier moves engine blocks itself has ended (``SupportsReopen``);
        returns whether this worker copies. Cheap enough to ask every step; never raises (a mover that
        fails to reopen is logged and stays closed). A closed worker, a worker halted with no mover (its
        remote tier moved the blocks, and is closed) or whose mover cannot reopen stays halted."""
        if self._closed:
            return False
        if not self._halted:
            return True
        mover: object = self._mover  # a BlockMover may or may not be SupportsReopen
        if not isinstance(mover, SupportsReopen) or self._remote_copies_blocks():
            return False
        try:
            if not mover.reopen():
                return False
        except Exception as exc:
            self._warnings.warn(f"rank {self._rank}: the halted mover did not reopen: {exc}")
            return False
        self._halted = False
        log.warning("kvcore: rank %d copies again: the copies that halted it have ended", self._rank)
        return True

    def _remote_copies_blocks(self) -> bool:
        """Whether a job of the remote tier that moves engine blocks itself is still in flight."""
        return any(
            queue is Queue.REMOTE and (run := self._runs.get(op_id)) is not None and tier_moves_blocks(run.op)
            for op_id, (queue, _) in self._current.items()
        )

    def close(self, flush_timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Write the chunks not yet written back to the tiers written back (at most ``flush_timeout``
        seconds), then stop the remote tier, then the mover (a failure is logged, never raised). Jobs
        not yet run fail; ops executed later fail (cache misses); reports keep coming until every op is
        reported."""
        if not self._closed:
            self._flush(flush_timeout)
        self._closed = True
        close_quietly(self._remote)
        close_quietly(self._mover)

    def _flush(self, timeout: float) -> None:
        """Write back what this rank's slots hold dirty, once the saves still publishing have ended."""
        remote = self._remote
        if self._dirty is None or not isinstance(remote, SupportsWriteBack):
            return
        deadline = time.monotonic() + timeout
        publishing = [
            i for i, run in self._runs.items() if run.stage is Stage.PUBLISH and not run.op.write_back
        ]
        if publishing:
            self._ready.extend(self.wait(publishing, timeout))  # ``wait`` takes the ready reports: kept
        self._dirty.write_back(remote, self._items, max(0.0, deadline - time.monotonic()), self._rank)

    def reports(self) -> tuple[OpReport, ...]:
        """Ops finished since the last call (never blocks)."""
        if self._mover is not None:
            self._advance(self._mover.poll(), Queue.MOVER)
        if self._remote is not None:
            self._advance(self._remote.poll(), Queue.REMOTE)
        return self._take()

    @property
    def orders_loads_on_device(self) -> bool:
        """Whether ``order_loads`` orders loads on the engine's device (``SupportsDeviceOrder``: a CUDA
        engine); where it does not, it orders none and the host waits for loads before the engine's work."""
        return self._device_mover() is not None

    def _device_mover(self) -> SupportsDeviceOrder | None:
        mover: object = self._mover  # a BlockMover may or may not be SupportsDeviceOrder
        return mover if isinstance(mover, SupportsDeviceOrder) and mover.orders_on_device else None

    def order_loads(self, op_ids: Collection[int]) -> set[int]:
        """Make the engine's work queued from now on (its forward pass) wait, on its device, for these
        loads' copies into its blocks, with no host wait; returns the ops so ordered: loads whose copy is
        queued on the mover. A load still fetching from the remote tier is not (its copy starts once the
        fetch ends: the host waits for it), nor is any load where the mover cannot order on the device
        (``orders_loads_on_device``). Ordered ops are reported as usual; a failed one's blocks hold
        undefined bytes, as always."""
        mover = self._device_mover()
        if mover is None:
            return set()
        ordered: set[int] = set()
        for op_id in op_ids:
            run, current = self._runs.get(op_id), self._current.get(op_id)
            if run is None or current is None or current[0] is not Queue.MOVER:
                continue
            if run.op.direction is Direction.LOAD and run.stage is Stage.COPY:
                mover.wait_loaded(current[1], 0.0)
                ordered.add(op_id)
        return ordered

    def wait(self, op_ids: Collection[int], timeout: float) -> tuple[OpReport, ...]:
        """Block until the given ops finished (e.g. a synchronous load before the forward pass).

        Returns every report that is ready, the awaited ones included. On timeout the unfinished ops are
        simply absent: they stay in flight (a copy may still touch their blocks, so their host slots stay
        reserved) and are reported by a later call; the caller treats their blocks as not loaded.
        """
        deadline = time.monotonic() + timeout
        while True:
            waiting = [self._current[o] for o in op_ids if o in self._current]
            if not waiting:
                break
            queue_id, _ = waiting[0]
            jobs = [job for q, job in waiting if q == queue_id]
            try:
                results = self._queue(queue_id).wait(jobs, max(0.0, deadline - time.monotonic()))
            except TransferTimeout as exc:
                log.warning("kvcore: %s", exc)
                break
            self._advance(results, queue_id)
        return self.reports()

    # -- stages ------------------------------------------------------------------------------------------

    def _queue(self, queue: Queue) -> JobQueue:
        found: JobQueue | None = self._mover if queue is Queue.MOVER else self._remote
        if found is None:
            raise UsageError(f"no {queue.value} attached")
        return found

    def _start_copy(self, run: Run) -> None:
        """Copy the op's blocks that have not failed already (a load never copies a chunk whose fetch
        failed: its slot holds no KV, and its blocks are the engine's to recompute)."""
        op = run.op
        run.stage = Stage.COPY
        run.copied = tuple(i for i in range(len(op.engine_blocks)) if i not in run.failed)
        if not run.copied:
            self._done(run)
            return
        engine = [op.engine_blocks[i] for i in run.copied]
        host = [op.host_blocks[i] for i in run.copied]
        try:
            if self._mover is None:
                raise UsageError("this worker has no host slots to copy to or from")
            job = self._mover.submit(BlockTransfer(op.direction, engine, host))
        except UsageError as exc:
            log.warning("kvcore: op %d refused by the mover: %s", op.op_id, exc)
            run.failed.update(range(len(op.engine_blocks)))
            run.error = str(exc)
            run.refused = True
            self._done(run)
            return
        self._track(run, Queue.MOVER, job)

    def _start_remote(self, run: Run, stage: Stage, chunks: Iterable[RemoteChunk] | None = None) -> None:
        """Fetch or publish ``chunks`` (those this rank has a key for; ``None``: every chunk of an op whose
        blocks the tier moves itself, engine blocks and all); a refused job fails them."""
        run.stage = stage
        chosen = run.op.remote if chunks is None else chunks
        run.staged = tuple(c for c in chosen if c.keys[self._rank] is not None)
        if not run.staged:
            self._next(run)
            return
        try:
            job = self._items.submit(self._remote, run, stage, blocks=chunks is None)
        except (BackendError, UsageError) as exc:
            self._warnings.warn(f"remote {stage.value} refused: {exc}")
            run.fail_chunks(run.staged)
            self._next(run)
            return
        self._track(run, Queue.REMOTE, job)

    def _track(self, run: Run, queue: Queue, job: JobId) -> None:
        self._jobs[(queue, job)] = run.op.op_id
        self._current[run.op.op_id] = (queue, job)

    def _advance(self, results: tuple[JobResult, ...], queue: Queue) -> None:
        for result in results:
            op_id = self._jobs.pop((queue, result.job_id), None)
            if op_id is None:
                continue  # not one of this worker's jobs
            del self._current[op_id]
            run = self._runs[op_id]
            if run.stage is Stage.COPY:
                if result.error is not None:
                    run.failed.update(range(len(run.op.engine_blocks)))
                    run.error = result.error
                else:
                    run.failed.update(run.copied[i] for i in result.failed)
            else:
                bad = result.failed_items(len(run.staged))  # a job that fails part-way keeps the rest
                run.fail_chunks([run.staged[i] for i in bad])
                if result.error is not None:
                    self._warnings.warn(f"remote {run.stage.value} failed: {result.error}")
                if run.stage is Stage.PUBLISH:
                    run.place(result, set(bad))
                    if self._dirty is not None:
                        self._dirty.published(run.op, run.staged, set(bad))
            self._next(run)

    def _next(self, run: Run) -> None:
        """Move a run whose current stage ended to its next stage, or report it."""
        op = run.op
        if run.stage is Stage.FETCH and not tier_moves_blocks(op) and not run.abandoned:
            self._start_copy(run)
        elif (
            run.stage is Stage.COPY
            and op.direction is Direction.SAVE
            and op.remote
            and self._remote
            and not run.abandoned
        ):
            intact = [c for c in op.remote if not run.failed.intersection(range(c.first, c.first + c.count))]
            self._start_remote(run, Stage.PUBLISH, intact)
        else:
            self._done(run)

    def _done(self, run: Run) -> None:
        del self._runs[run.op.op_id]
        error = run.error or ("fenced" if run.abandoned else None)
        intact = run.refused or run.abandoned  # its failure says nothing of the chunks' bytes
        placed = tuple(run.placed.get(i, ()) for i in range(len(run.op.remote))) if run.placed else ()
        report = OpReport(run.op.op_id, self._rank, tuple(sorted(run.failed)), error, intact, placed)
        self._ready.append(report)
        self._sessions.op_done(run.op.request_id, busy=self._busy(run.op.request_id))

    def _busy(self, request_id: str) -> bool:
        """Whether an op of the request is still in flight here."""
        return any(r.op.request_id == request_id for r in self._runs.values())

    def _take(self) -> tuple[OpReport, ...]:
        out, self._ready = tuple(self._ready), []
        return out
