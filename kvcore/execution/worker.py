"""The worker side for any engine: executes the scheduler's block ops through a ``BlockMover``, and through
a remote tier when one is attached.

Workers own memory and execute; they decide nothing (docs/architecture.md, "Where things run"). An op
is one mover job, preceded by a fetch (a load of chunks the remote tier holds) or followed by a publish (a
save to the remote tier); a write-back op is a publish alone (pool chunks to the tiers written back). An
op whose chunks have no host slot is one remote job instead: the remote tier moves the engine blocks
itself (``BlockRemote``). Every op is reported exactly once, failures included — a copy the mover refused
is reported as failed at once — so the scheduler never waits for an op that will not come.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Collection, Iterable

from kvcore.errors import BackendError, TransferTimeout, UsageError
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobResult
from kvcore.kit.closing import close_quietly
from kvcore.kit.repeats import RepeatedWarnings
from kvcore.model.step import WRITE_BACK_SESSION, BlockOp, OpReport, RemoteChunk, StepPlan
from kvcore.ports import (
    BlockItem,
    BlockMover,
    BlockRemote,
    BlockTransfer,
    Direction,
    HeldChunks,
    JobQueue,
    RemoteTier,
    StoreItem,
    SupportsDeviceOrder,
    SupportsReopen,
    SupportsWriteBack,
)

__all__ = ["FLUSH_TIMEOUT_S", "BlockWorker"]

FLUSH_TIMEOUT_S = 30.0
"""How long ``BlockWorker.close`` gives the chunks not yet written back to reach the tiers written back."""

log = logging.getLogger(__name__)


class _Stage(enum.Enum):
    FETCH = "fetch"
    COPY = "copy"
    PUBLISH = "publish"


class _Run:
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
        self.stage = _Stage.COPY
        self.failed: set[int] = set()
        self.error: str | None = None
        self.staged: tuple[RemoteChunk, ...] = ()  # the chunks of the current remote job, in item order
        self.placed: dict[int, tuple[int, ...]] = {}  # published chunk (index in op.remote) -> its tiers
        self.copied: tuple[int, ...] = ()  # the op's block indices in the mover job, in its order


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
        self._slot_bytes = slot_bytes
        self._slot_blocks = slot_blocks
        self._runs: dict[int, _Run] = {}  # op id -> run, until reported
        self._jobs: dict[tuple[int, JobId], int] = {}  # (queue, job) -> op id
        self._current: dict[int, tuple[int, JobId]] = {}  # op id -> its job in flight
        self._ready: list[OpReport] = []
        self._ending: set[str] = set()  # ended requests whose sessions end after their last op
        self._chains: dict[str, list[ChunkKey]] = {}  # request id -> this rank's chain, with a remote tier
        # slot -> the chunk saved into it and not yet written back, with tiers written back
        self._dirty: dict[int, RemoteChunk] | None = (
            {} if isinstance(remote, SupportsWriteBack) and remote.writes_back else None
        )

    def execute(self, plan: StepPlan) -> None:
        """Fence the plan's ``fenced`` ops, then start every op of the plan; returns at once (unless a
        fenced load is still copying into engine blocks: that copy is waited for, see ``fence``)."""
        fenced = set(plan.fenced)
        if fenced:
            self.fence(fenced)
        for op in plan.ops:
            if self._dirty:
                self._overwritten(op)
            if op.chain and self._remote is not None:
                self._extend_chain(op)
            if op.held is not None:
                self._adopt(op, op.held)
            run = _Run(op, tuple(self._chains.get(op.request_id, ())) if op.remote else ())
            self._runs[op.op_id] = run
            if op.op_id in fenced:  # its blocks were freed before it could start: it moves nothing
                run.abandoned = True
                run.failed.update(range(len(op.engine_blocks)))
                self._done(run)
                continue
            if op.write_back:  # the pool's slots to the tiers written back: no engine block
                self._start_remote(run, _Stage.PUBLISH, op.remote)
                continue
            if _direct(op):
                self._start_remote(run, _Stage.FETCH if op.direction is Direction.LOAD else _Stage.PUBLISH)
                continue
            if op.direction is Direction.LOAD and op.remote:
                if self._remote is not None:
                    self._start_remote(run, _Stage.FETCH, op.remote)
                    continue
                log.warning("kvcore: op %d needs a remote tier this worker lacks", op.op_id)
                self._fail_chunks(run, op.remote)  # their slots hold no fetched bytes
            self._start_copy(run)
        for request_id in plan.ended:
            self._ending.add(request_id)
            self._end_session(request_id)

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
            if save and run.stage is _Stage.PUBLISH and not _direct(run.op):
                continue  # its copy into the host slot finished before now: the bytes are the KV
            run.abandoned = True
            run.failed.update(range(len(run.op.engine_blocks)))
            current = self._current.get(op_id)
            if current is None:
                continue
            tier = self._remote if current[0] == self._REMOTE else None
            remote = tier if isinstance(tier, BlockRemote) else None  # a tier that can give a job up
            if save:
                if remote is not None:
                    remote.abandon(current[1])
            else:
                copying = run.stage is _Stage.COPY  # a copy from the host slot: queued or running
                if copying or (_direct(run.op) and (remote is None or remote.abandon(current[1]))):
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
            queue == self._REMOTE and (run := self._runs.get(op_id)) is not None and _direct(run.op)
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
            i for i, run in self._runs.items() if run.stage is _Stage.PUBLISH and not run.op.write_back
        ]
        if publishing:
            self._ready.extend(self.wait(publishing, timeout))  # ``wait`` takes the ready reports: kept
        if not self._dirty:
            return
        chunks = list(self._dirty.values())
        self._dirty.clear()
        try:
            job = remote.submit_write_back(WRITE_BACK_SESSION, [self._store_item(c) for c in chunks])
            results = remote.wait([job], max(0.0, deadline - time.monotonic()))
        except (BackendError, UsageError, TransferTimeout) as exc:
            log.warning(
                "kvcore: rank %d: %d chunks not written back at close: %s", self._rank, len(chunks), exc
            )
            return
        lost = len(chunks) if not results or results[0].error else len(results[0].failed)
        if lost:
            log.warning(
                "kvcore: rank %d: %d of %d chunks not written back at close", self._rank, lost, len(chunks)
            )
        else:
            log.info("kvcore: rank %d wrote %d chunks back at close", self._rank, len(chunks))

    def reports(self) -> tuple[OpReport, ...]:
        """Ops finished since the last call (never blocks)."""
        if self._mover is not None:
            self._advance(self._mover.poll(), self._MOVER)
        if self._remote is not None:
            self._advance(self._remote.poll(), self._REMOTE)
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
            if run is None or current is None or current[0] != self._MOVER:
                continue
            if run.op.direction is Direction.LOAD and run.stage is _Stage.COPY:
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

    _MOVER = 0
    _REMOTE = 1

    def _queue(self, queue_id: int) -> JobQueue:
        queue: JobQueue | None = self._mover if queue_id == self._MOVER else self._remote
        if queue is None:
            raise UsageError(f"no {'mover' if queue_id == self._MOVER else 'remote tier'} attached")
        return queue

    def _start_copy(self, run: _Run) -> None:
        """Copy the op's blocks that have not failed already (a load never copies a chunk whose fetch
        failed: its slot holds no KV, and its blocks are the engine's to recompute)."""
        op = run.op
        run.stage = _Stage.COPY
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
        self._track(run, self._MOVER, job)

    def _start_remote(self, run: _Run, stage: _Stage, chunks: Iterable[RemoteChunk] | None = None) -> None:
        """Fetch or publish ``chunks`` (those this rank has a key for; ``None``: every chunk of a direct
        op, engine blocks and all); a refused job fails them."""
        remote = self._remote
        run.stage = stage
        chosen = run.op.remote if chunks is None else chunks
        run.staged = tuple(c for c in chosen if c.keys[self._rank] is not None)
        if not run.staged:
            self._next(run)
            return
        chain = run.chain
        fetch = stage is _Stage.FETCH
        try:
            if remote is None:
                raise UsageError("no remote tier attached")
            if chunks is None:
                if not isinstance(remote, BlockRemote):
                    raise BackendError(f"{type(remote).__name__} cannot move engine blocks itself")
                blocks = [self._block_item(run.op, c) for c in run.staged]
                submit_blocks = remote.submit_fetch_blocks if fetch else remote.submit_publish_blocks
                job = submit_blocks(run.op.request_id, blocks, chain)
            elif run.op.write_back:
                if not isinstance(remote, SupportsWriteBack):
                    raise UsageError(f"{type(remote).__name__} has no tier written back")
                job = remote.submit_write_back(run.op.request_id, [self._store_item(c) for c in run.staged])
            else:
                items = [self._store_item(c) for c in run.staged]
                submit = remote.submit_fetch if fetch else remote.submit_publish
                job = submit(run.op.request_id, items, chain)
        except (BackendError, UsageError) as exc:
            self._warnings.warn(f"remote {stage.value} refused: {exc}")
            self._fail_chunks(run, run.staged)
            self._next(run)
            return
        self._track(run, self._REMOTE, job)

    def _store_item(self, chunk: RemoteChunk) -> StoreItem:
        key, slot, blocks = chunk.keys[self._rank], chunk.slot, chunk.value_blocks
        if key is None or slot is None:
            raise UsageError(f"chunk {chunk} has no key for rank {self._rank} or no host slot")
        if blocks is not None and blocks >= self._slot_blocks:
            raise UsageError(f"chunk {chunk}: a tail of {blocks} blocks, slots hold {self._slot_blocks}")
        length = self._slot_bytes if blocks is None else self._slot_bytes // self._slot_blocks * blocks
        return StoreItem(key, slot * self._slot_bytes, length)

    def _block_item(self, op: BlockOp, chunk: RemoteChunk) -> BlockItem:
        key = chunk.keys[self._rank]
        if key is None:
            raise UsageError(f"chunk {chunk} has no key for rank {self._rank}")
        blocks = op.engine_blocks[chunk.first : chunk.first + chunk.count]
        return BlockItem(key, blocks, chunk.from_block, chunk.value_blocks)

    def _extend_chain(self, op: BlockOp) -> None:
        """Put the op's chain delta at ``chain_from`` of its request's chain (dropping what followed)."""
        chain = self._chains.setdefault(op.request_id, [])
        if op.chain_from > len(chain):
            log.warning(
                "kvcore: op %d: chain of %s resumes at %d past its %d known keys; left as it is",
                op.op_id,
                op.request_id,
                op.chain_from,
                len(chain),
            )
            return
        del chain[op.chain_from :]
        chain.extend(keys[self._rank] for keys in op.chain)

    def _adopt(self, op: BlockOp, held: HeldChunks) -> None:
        """Take over this rank's locks of the op's held chunks, before anything reads them (even for a
        fenced op: the tier releases them with the session)."""
        chain = self._chains.get(op.request_id, [])
        if self._remote is None or self._rank >= len(held.holders) or len(chain) < held.end:
            log.warning(
                "kvcore: op %d: locks on chunks [%d, %d) of %s not taken over (%d holders, %d keys known)",
                op.op_id,
                held.start,
                held.end,
                op.request_id,
                len(held.holders),
                len(chain),
            )
            return
        self._remote.adopt(op.request_id, held.holders[self._rank], chain[: held.end], held.start, held.end)

    def _track(self, run: _Run, queue_id: int, job: JobId) -> None:
        self._jobs[(queue_id, job)] = run.op.op_id
        self._current[run.op.op_id] = (queue_id, job)

    def _advance(self, results: tuple[JobResult, ...], queue_id: int) -> None:
        for result in results:
            op_id = self._jobs.pop((queue_id, result.job_id), None)
            if op_id is None:
                continue  # not one of this worker's jobs
            del self._current[op_id]
            run = self._runs[op_id]
            if run.stage is _Stage.COPY:
                if result.error is not None:
                    run.failed.update(range(len(run.op.engine_blocks)))
                    run.error = result.error
                else:
                    run.failed.update(run.copied[i] for i in result.failed)
            else:
                bad = result.failed_items(len(run.staged))  # a job that fails part-way keeps the rest
                self._fail_chunks(run, [run.staged[i] for i in bad])
                if result.error is not None:
                    self._warnings.warn(f"remote {run.stage.value} failed: {result.error}")
                if run.stage is _Stage.PUBLISH:
                    self._place(run, result, set(bad))
                    if self._dirty is not None:
                        _track_dirty(self._dirty, run, set(bad))
            self._next(run)

    def _next(self, run: _Run) -> None:
        """Move a run whose current stage ended to its next stage, or report it."""
        op = run.op
        if run.stage is _Stage.FETCH and not _direct(op) and not run.abandoned:
            self._start_copy(run)
        elif (
            run.stage is _Stage.COPY
            and op.direction is Direction.SAVE
            and op.remote
            and self._remote
            and not run.abandoned
        ):
            intact = [c for c in op.remote if not run.failed.intersection(range(c.first, c.first + c.count))]
            self._start_remote(run, _Stage.PUBLISH, intact)
        else:
            self._done(run)

    def _place(self, run: _Run, result: JobResult, bad: set[int]) -> None:
        """Record the tiers that stored each chunk of a finished publish (one tier: those not failed)."""
        position = {chunk.first: i for i, chunk in enumerate(run.op.remote)}
        for j, chunk in enumerate(run.staged):
            if result.placed and j < len(result.placed):
                tiers = result.placed[j] if j not in bad else ()
            else:
                tiers = () if j in bad else (0,)
            run.placed[position[chunk.first]] = tiers

    def _overwritten(self, op: BlockOp) -> None:
        """Slots the op writes (a save's, a fetch's) no longer hold the chunk that was dirty there: the pool
        gave it up, written back or dropped."""
        dirty = self._dirty
        if dirty is None or op.write_back:
            return
        if op.direction is Direction.SAVE:
            for block in op.host_blocks:
                dirty.pop(block // self._slot_blocks, None)
        else:
            for chunk in op.remote:
                if chunk.slot is not None:
                    dirty.pop(chunk.slot, None)

    def _fail_chunks(self, run: _Run, chunks: Iterable[RemoteChunk]) -> None:
        for chunk in chunks:
            run.failed.update(range(chunk.first, chunk.first + chunk.count))

    def _done(self, run: _Run) -> None:
        del self._runs[run.op.op_id]
        error = run.error or ("fenced" if run.abandoned else None)
        intact = run.refused or run.abandoned  # its failure says nothing of the chunks' bytes
        placed = tuple(run.placed.get(i, ()) for i in range(len(run.op.remote))) if run.placed else ()
        report = OpReport(run.op.op_id, self._rank, tuple(sorted(run.failed)), error, intact, placed)
        self._ready.append(report)
        if run.op.request_id in self._ending:
            self._end_session(run.op.request_id)

    def _end_session(self, request_id: str) -> None:
        """End an ended request's session on the remote tier once none of its ops is in flight."""
        if any(r.op.request_id == request_id for r in self._runs.values()):
            return
        self._ending.discard(request_id)
        self._chains.pop(request_id, None)
        if self._remote is not None:
            try:
                self._remote.end_session(request_id)
            except BackendError as exc:
                log.warning("kvcore: ending the session of %s failed: %s", request_id, exc)

    def _take(self) -> tuple[OpReport, ...]:
        out, self._ready = tuple(self._ready), []
        return out


def _track_dirty(dirty: dict[int, RemoteChunk], run: _Run, bad: set[int]) -> None:
    """A save's published chunks are dirty in their slots; a write-back's are not, whatever its outcome
    (the scheduler counts them clean)."""
    for j, chunk in enumerate(run.staged):
        if chunk.slot is None:
            continue
        if run.op.write_back:
            dirty.pop(chunk.slot, None)
        elif j not in bad:
            dirty[chunk.slot] = chunk


def _direct(op: BlockOp) -> bool:
    """Whether the remote tier moves the op's blocks itself (its chunks have no host slot)."""
    return bool(op.remote) and op.remote[0].slot is None
