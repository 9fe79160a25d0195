"""``kvcore fuzz``: a seeded lifecycle fuzzer of the engine-agnostic API, checked against a KV oracle.

A model engine drives ``CacheScheduler`` and a ``BlockWorker`` over the CPU tier's real mover (and, with
``remote``, the in-memory reference store and index behind the pool) the way ``docs/engine-api.md`` says an
engine does: multi-turn chats over shared prefixes with per-request salts, chunked prefill and decode, its
own prefix cache, finishes and aborts at every point, preemptions whose blocks go to other requests at
once, resets with copies in flight, lookups by tokens and by the engine's own chained block hashes. Faults
come through every port: mover and remote jobs that fail (wholly or in part) or finish steps late, remote
lookups that fail or answer late.

The engine "computes" KV deterministically: block ``j`` of a request holds a pure function of the engine's
epoch (a reset stands for a weight update, after which the same tokens have other KV), the request's salt
and its tokens up to the end of the block, or up to its last computed token. So every block kvcore loads
is checked byte for byte, and so is every block the engine holds, after every step: bytes of another
request, another salt, an earlier epoch, a failed copy or a block never written are told apart, and named
in the error. A shadow of every block handed to ``save`` (its bytes at that moment) must also match what
a load brings back.

A seed fixes the run: decisions come from ``random.Random`` streams derived from it, and no copy runs when
a thread gets round to it: the fuzzer's mover and remote tier hold each job until the step its seeded fate
names, then run it to completion through the real parts. ``kvcore fuzz --seed S --steps N`` replays a run.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import itertools
import random
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import NoReturn, cast

import numpy as np
import numpy.typing as npt
import torch
from attrs import Factory, define, frozen

from kvcore.config import load_config
from kvcore.engine import EngineSpec
from kvcore.errors import BackendError, TransferTimeout, UsageError
from kvcore.hashing import ExtraKeys
from kvcore.ids import ChunkKey, JobId, LookupId, RequestId
from kvcore.jobs import JobBoard, JobResult
from kvcore.layout import KVLayout, LayoutKind
from kvcore.plan import BlockOp, OpReport
from kvcore.ports import BlockMover, BlockTransfer, Direction, StoreItem
from kvcore.remote import StoreRemote
from kvcore.scheduler import CacheScheduler
from kvcore.testing.memory import POISON, InMemoryChunkIndex, InMemoryChunkStore
from kvcore.worker import BlockWorker
from kvcore_cpu.tier import open_worker, pool_slots

__all__ = ["FuzzFailure", "FuzzOptions", "FuzzSummary", "run_fuzz"]

Bytes = npt.NDArray[np.uint8]

BLOCK_TOKENS = 4
CHUNK_TOKENS = 12  # three blocks a chunk: loads start inside chunks the engine partly holds
LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 4
HASH_IDENTITY = "kvcore-fuzz/sha256-block-chain"
MAX_TOKENS = 96  # no request grows past this: the engine can always hold one
MAX_LIVE = 10  # requests waiting or running at once
VOCAB = 50_000
WAIT_S = 5.0  # what the engine passes to ``wait``; the fuzzer's queues decide without waiting on it
INNER_WAIT_S = 60.0  # a real copy, run to completion when its job falls due
LOOKUP_TIMEOUT_S = 86_400.0  # lookups end by steps, never by the machine's speed
DRAIN_STEPS = 12  # more than any job is held: every copy falls due while draining

P_NEW_CHAT = 0.5
P_ABORT = 0.06
P_PREEMPT = 0.08
P_RESET = 0.02
P_LATE = 0.3  # a job finishes 1 to 3 steps late
P_STUCK = 0.05  # of late jobs: not even a patient wait (a fence) sees it finish sooner
PATIENT_S = 10.0  # a wait this long sees a late job finish (the engine's own waits are shorter)
P_FAIL = 0.07  # a job fails, wholly or in part
P_STALL = 0.06  # the remote index answers nothing for 1 to 4 steps
P_LOOKUP_FAIL = 0.1


@frozen
class FuzzOptions:
    """What a run exercises. Every field is a flag of ``kvcore fuzz``, so a failure's replay line is exact.

    ``engine_blocks`` is the engine's KV memory (few, so blocks are reused at once) and ``pool_slots`` the
    host pool in chunks (few, so chunks are evicted).
    """

    remote: bool = False
    preempt: bool = True
    reset: bool = True
    faults: bool = True
    recompute_late: bool = True  # rule 4: recompute a late load's blocks at once (half the time), or hold
    engine_blocks: int = 40
    pool_slots: int = 16
    trace: int = 40  # API calls shown with a failure

    def flags(self) -> str:
        """The command-line flags that select these options (defaults left out)."""
        default = FuzzOptions()
        out = ["--remote"] if self.remote else []
        out += [f"--no-{name}" for name in ("preempt", "reset", "faults") if not getattr(self, name)]
        out += [] if self.recompute_late else ["--hold-late-loads"]
        out += [
            f"--{name.replace('_', '-')} {getattr(self, name)}"
            for name in ("engine_blocks", "pool_slots")
            if getattr(self, name) != getattr(default, name)
        ]
        return " ".join(out)


@define
class FuzzSummary:
    """What one run did; a test asserts on it that the run really exercised each part."""

    seed: int
    steps: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    preemptions: int = 0
    resets: int = 0
    lookups: int = 0
    hash_lookups: int = 0  # of ``lookups``: by the engine's block hashes
    loads_checked: int = 0
    blocks_verified: int = 0
    blocks_recomputed: int = 0  # in loads: reported failed or lost, computed again
    loads_given_up: int = 0  # late loads whose blocks were recomputed while the copy was in flight
    saved_chunks: int = 0
    mover_faults: int = 0
    remote_faults: int = 0
    lookup_faults: int = 0
    index_stalls: int = 0
    late_jobs: int = 0
    evictions: int = 0
    halted_at: int | None = None  # the step a fence gave up on a copy and stopped the worker for good

    @property
    def faults(self) -> int:
        return self.mover_faults + self.remote_faults + self.lookup_faults

    def brief(self) -> str:
        return (
            f"seed {self.seed}: ok, {self.steps} steps, {self.requests} requests, {self.loads_checked} loads "
            f"checked ({self.blocks_verified} blocks verified), {self.preemptions} preemptions, "
            f"{self.resets} resets, {self.faults} faults"
        )

    def render(self) -> str:
        rows = [
            ("seed / steps", f"{self.seed} / {self.steps}"),
            (
                "requests",
                f"{self.requests} ({self.finished} finished, {self.aborted} aborted, "
                f"{self.preemptions} preemptions)",
            ),
            ("lookups", f"{self.lookups} ({self.hash_lookups} by block hashes)"),
            ("loads checked", f"{self.loads_checked}"),
            (
                "blocks verified",
                f"{self.blocks_verified} (and {self.blocks_recomputed} failed or lost: recomputed)",
            ),
            ("chunks saved", f"{self.saved_chunks} ({self.evictions} evictions)"),
            ("resets", f"{self.resets}"),
            ("worker", "running" if self.halted_at is None else f"halted at step {self.halted_at}"),
            (
                "faults injected",
                f"{self.faults} ({self.mover_faults} mover, {self.remote_faults} remote, "
                f"{self.lookup_faults} lookups); {self.late_jobs} jobs late, "
                f"{self.index_stalls} index stalls",
            ),
            ("verification", "OK: every check held after every step"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(["", "kvcore fuzz summary", *(f"  {k:<{width}}  {v}" for k, v in rows)])


class FuzzFailure(Exception):
    """A check failed: the seed, the step, the request and what differed, a replay line, the last calls."""

    def __init__(
        self, seed: int, step: int, request: str | None, detail: str, replay: str, trace: Sequence[str]
    ) -> None:
        self.seed = seed
        self.step = step
        self.request = request
        self.detail = detail
        self.replay = replay
        self.trace = tuple(trace)
        about = f" ({request})" if request else ""
        lines = [
            f"kvcore fuzz: check failed at step {step}, seed {seed}{about}: {detail}",
            f"  replay: {replay}",
        ]
        if self.trace:
            lines.append(f"  last {len(self.trace)} calls:")
            lines += [f"    {line}" for line in self.trace]
        super().__init__("\n".join(lines))


def run_fuzz(seed: int, steps: int, options: FuzzOptions | None = None) -> FuzzSummary:
    """Run ``steps`` engine steps from ``seed``, then drain; ``FuzzFailure`` on the first failed check."""
    return _Fuzz(seed, steps, options or FuzzOptions()).run()


# -- the ports, with seeded fates ----------------------------------------------------------------------


class _Clock:
    """The step the run is at: when a held job falls due."""

    def __init__(self) -> None:
        self.step = 0


class _Postponed:
    """A job queue whose jobs run when the seed says: each is held until its step comes, then run to
    completion through the real part it wraps, so that no copy depends on when a thread gets round to it.

    ``wait`` never blocks. A late job outlasts the engine's short waits (``TransferTimeout``) but not a
    patient one (``PATIENT_S`` or more, as a fence's): that runs it at once. A stuck job outlasts every
    wait and runs only when its step comes. ``close`` fails the jobs still held, and refuses new ones,
    as a closed mover does.
    """

    def __init__(self, clock: _Clock, rng: random.Random, chaos: bool) -> None:
        self._clock = clock
        self._rng = rng
        self._chaos = chaos
        self._board = JobBoard()
        self._held: dict[JobId, _Held] = {}
        self.closed_at: int | None = None
        self.late = 0
        self.failed = 0

    def held(self) -> int:
        return len(self._held)

    def poll(self) -> tuple[JobResult, ...]:
        self._release(())
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        self._release(job_ids if timeout >= PATIENT_S else ())
        late = sorted(j for j in job_ids if j in self._held)
        if late:
            raise TransferTimeout(f"jobs {late} are held until a later step")
        return self._board.wait(job_ids, 0.0)

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = self._clock.step
        held, self._held = self._held, {}
        for job, entry in held.items():
            self._board.finish(JobResult(job, tuple(range(entry.items)), "closed before the job ran"))

    def _fate(self, items: int) -> tuple[int, bool, int]:
        """How many steps late a new job of ``items`` items finishes, whether it is stuck till then, and
        how many of its items fail."""
        if not self._chaos or items == 0:
            return 0, False, 0
        delay = self._rng.choice((1, 1, 2, 3)) if self._rng.random() < P_LATE else 0
        stuck = delay > 0 and self._rng.random() < P_STUCK
        failing = 0
        if self._rng.random() < P_FAIL:
            failing = items if self._rng.random() < 0.5 else self._rng.randint(1, items)
        self.late += delay > 0
        self.failed += failing > 0
        return delay, stuck, failing

    def _hold(self, fate: tuple[int, bool, int], items: int, run: Callable[[JobId], JobResult]) -> JobId:
        if self.closed_at is not None:
            raise UsageError(f"{type(self).__name__} is closed")
        job = self._board.new()
        self._held[job] = _Held(self._clock.step + fate[0], fate[1], items, run)
        return job

    def _release(self, asked: Collection[JobId]) -> None:
        """Run the jobs whose step has come, and the asked ones that are not stuck, in submission order."""
        now = self._clock.step
        for job in [j for j, h in self._held.items() if h.step <= now or (j in asked and not h.stuck)]:
            self._board.finish(self._held.pop(job).run(job))


@frozen
class _Held:
    step: int  # when it runs unasked
    stuck: bool  # not even a patient wait runs it sooner
    items: int
    run: Callable[[JobId], JobResult]


class _FaultyMover(_Postponed):
    """The ``BlockMover`` port over the real mover, with seeded fates: a failed copy also leaves garbage in
    its destination blocks (``spoil``), as the port allows.

    Transfers the real mover refuses are kept in ``refused``: the engine never hands kvcore bad block ids,
    so each is a copy kvcore planned wrongly (a destination twice, a block out of range).
    """

    def __init__(
        self,
        inner: BlockMover,
        clock: _Clock,
        rng: random.Random,
        chaos: bool,
        spoil: Callable[[Direction, int, str], None],
    ) -> None:
        super().__init__(clock, rng, chaos)
        self._inner = inner
        self._spoil = spoil
        self.refused: list[str] = []

    def submit(self, transfer: BlockTransfer) -> JobId:
        size = len(transfer.engine_blocks)
        fate = self._fate(size)
        spoilt = tuple(sorted(self._rng.sample(range(size), fate[2])))
        return self._hold(fate, size, partial(self._run, transfer, spoilt))

    def _run(self, transfer: BlockTransfer, spoilt: tuple[int, ...], job: JobId) -> JobResult:
        size = len(transfer.engine_blocks)
        try:
            inner = self._inner.submit(transfer)
        except UsageError as exc:
            self.refused.append(f"{_transfer(transfer)}: {exc}")
            return JobResult(job, tuple(range(size)), str(exc))
        (result,) = self._inner.wait([inner], INNER_WAIT_S)
        load = transfer.direction is Direction.LOAD
        for i in spoilt:
            block = transfer.engine_blocks[i] if load else transfer.host_blocks[i]
            self._spoil(transfer.direction, block, f"garbage of failed {transfer.direction.value} job {job}")
        whole = len(spoilt) == size and size > 0
        error = result.error or ("injected: the copy failed" if whole else None)
        return JobResult(job, tuple(sorted({*result.failed, *spoilt})), error)


class _FaultyRemote(_Postponed):
    """The remote tier (``StoreRemote`` over the in-memory reference store) with seeded fates: items fail
    through the store's own ``fail_next``. A publish registers the keys it stored in the remote index, as
    a store's metadata service would; the index is not told of evictions, so it may promise a chunk the
    store lost (the fetch then misses)."""

    def __init__(
        self,
        store: InMemoryChunkStore,
        index: InMemoryChunkIndex,
        clock: _Clock,
        rng: random.Random,
        chaos: bool,
    ) -> None:
        super().__init__(clock, rng, chaos)
        self._store = store
        self._index = index
        self._remote = StoreRemote(store)

    def submit_fetch(self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()) -> JobId:
        return self._submit(self._remote.submit_fetch, session, items, chain, publish=False)

    def submit_publish(
        self, session: str, items: Sequence[StoreItem], chain: Sequence[ChunkKey] = ()
    ) -> JobId:
        return self._submit(self._remote.submit_publish, session, items, chain, publish=True)

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
        work = partial(self._run, submit, session, tuple(items), tuple(chain), fate[2], publish)
        return self._hold(fate, len(items), work)

    def _run(
        self,
        submit: Callable[[str, Sequence[StoreItem], Sequence[ChunkKey]], JobId],
        session: str,
        items: tuple[StoreItem, ...],
        chain: tuple[ChunkKey, ...],
        failing: int,
        publish: bool,
        job: JobId,
    ) -> JobResult:
        if failing:
            self._store.fail_next(failing)
        (result,) = self._remote.wait([submit(session, items, chain)], INNER_WAIT_S)
        if publish:
            self._index.add(item.key for i, item in enumerate(items) if i not in result.failed)
        return JobResult(job, result.failed, result.error)


class _GuardedIndex:
    """The remote index the scheduler asks: the in-memory reference, failing through its own ``fail_next``
    but never twice in a row. Three failures in a row open the lookup's circuit breaker, whose back-off is
    wall-clock time: the run would then depend on the machine's speed."""

    def __init__(self, inner: InMemoryChunkIndex) -> None:
        self.inner = inner
        self.failures = 0
        self._armed = False
        self._in_a_row = 0

    def inject_failure(self) -> None:
        """Make the next answered lookup fail, unless the last one failed or a failure is pending."""
        if not self._armed and not self._in_a_row:
            self.inner.fail_next(1)
            self._armed = True

    def submit_lookup(
        self, chunks: Sequence[Sequence[ChunkKey]], preceding: Sequence[Sequence[ChunkKey]] = ()
    ) -> LookupId:
        return self.inner.submit_lookup(chunks, preceding)

    def poll_lookup(self, lookup_id: LookupId) -> int | None:
        try:
            answer = self.inner.poll_lookup(lookup_id)
        except BackendError:
            self._armed = False
            self._in_a_row += 1
            self.failures += 1
            raise
        if answer is not None:
            self._in_a_row = 0
        return answer

    def cancel_lookup(self, lookup_id: LookupId) -> None:
        self.inner.cancel_lookup(lookup_id)


# -- the model engine ----------------------------------------------------------------------------------


class _State(enum.Enum):
    WAITING = "waiting"  # queued: new, or preempted and not resumed yet
    LOADING = "loading"  # blocks allocated, kvcore's load not reported yet: the request does not run
    RUNNING = "running"  # prefill or decode


@frozen
class _Chat:
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
class _Request:
    """One request as the engine sees it; ``blocks`` and what follows belong to its current admission."""

    rid: RequestId
    chat: _Chat
    turn: int
    prefix_cache: bool  # whether the engine reads its own prefix cache for it (kvcore then adds more)
    tokens: list[int]
    outputs_left: int
    hashes: list[bytes] = Factory(list)  # chained hash of each full block of ``tokens``
    state: _State = _State.WAITING
    looked_up: bool = False
    blocks: list[int] = Factory(list)
    computed: int = 0  # tokens whose KV the blocks hold
    epoch: int = 0
    promised: range = range(0)  # request block indices the load covers: what lookup offered
    queued: int = 0  # of them, leading blocks start_load queued (the others must be reported lost)
    errors: set[int] = Factory(set)  # engine blocks take_load_errors named for this load
    load_ops: set[int] = Factory(set)  # this load's ops not reported yet
    gave_up: bool = False  # the load was late: its blocks are recomputed, whatever it reports
    shadowed: int = 0  # leading blocks whose bytes were recorded when handed to save


def _pack(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _fingerprint(data: Bytes) -> bytes:
    return hashlib.blake2b(data.tobytes(), digest_size=16).digest()


def _transfer(transfer: BlockTransfer) -> str:
    return f"{transfer.direction.value} e{list(transfer.engine_blocks)} h{list(transfer.host_blocks)}"


def _op(op: BlockOp) -> str:
    remote = f" remote{[c.keys[0][-8:] if c.keys[0] else None for c in op.remote]}" if op.remote else ""
    blocks = f"e{list(op.engine_blocks)} h{list(op.host_blocks)}"
    return f"{op.direction.value}#{op.op_id} {op.request_id} {blocks}{remote}"


class _Fuzz:
    """One run: the engine, kvcore's two sides over it, the oracle and the checks."""

    def __init__(self, seed: int, steps: int, options: FuzzOptions) -> None:
        self.seed, self.steps, self.options = seed, steps, options
        self.rng = random.Random(f"kvcore-fuzz:{seed}:engine")
        self.summary = FuzzSummary(seed=seed)
        self.clock = _Clock()
        self.trace: deque[str] = deque(maxlen=options.trace)
        self.epoch = 0
        n = options.engine_blocks
        layout = KVLayout(
            kind=LayoutKind.VLLM_CPU,
            num_blocks=n,
            block_tokens=BLOCK_TOKENS,
            num_kv_heads=KV_HEADS,
            head_size=HEAD_SIZE,
            dtype_size=2,
        )
        spec = EngineSpec(
            model_id="kvcore-fuzz",
            kv_dtype="bfloat16",
            num_layers=LAYERS,
            total_kv_heads=KV_HEADS,
            layout=layout,
        )
        storage = torch.zeros((LAYERS, n, KV_HEADS, BLOCK_TOKENS, 2 * HEAD_SIZE), dtype=torch.bfloat16)
        # [layer, block, head, token slot, K and V bytes]: a block's bytes, slot by slot
        self.kv: Bytes = storage.view(torch.uint8).numpy()
        slot_bytes = CHUNK_TOKENS // BLOCK_TOKENS * spec.host_block_bytes
        config = load_config(
            {
                "backend": {"kind": "cpu", "size": options.pool_slots * slot_bytes},
                "chunk_tokens": CHUNK_TOKENS,
                "lookup_timeout_s": LOOKUP_TIMEOUT_S,
            }
        )
        self.cpu = open_worker(config, spec, list(storage.unbind(0)))
        if self.cpu.mover is None or self.cpu.host is None:
            raise UsageError("the CPU tier opened without a host pool")
        host = self.cpu.host
        self.host_kv: Bytes = host.blocks.numpy().reshape(-1, LAYERS, *self.kv.shape[2:])
        self.mover = _FaultyMover(
            self.cpu.mover,
            self.clock,
            random.Random(f"kvcore-fuzz:{seed}:mover"),
            options.faults,
            self._spoil,
        )
        self.index: _GuardedIndex | None = None
        self.remote: _FaultyRemote | None = None
        if options.remote:
            self.index = _GuardedIndex(InMemoryChunkIndex())
            # the store reads and writes the pool's own bytes, as a Mooncake client registers them; a
            # memoryview slices and assigns as the bytearray it is annotated with does
            view = cast(bytearray, host.buffer.numpy().data)
            store = InMemoryChunkStore(view, capacity=4 * options.pool_slots * slot_bytes)
            rng = random.Random(f"kvcore-fuzz:{seed}:remote")
            self.remote = _FaultyRemote(store, self.index.inner, self.clock, rng, options.faults)
        self.sched = CacheScheduler(
            config, spec, pool_slots(config, spec), hash_identity=HASH_IDENTITY, remote=self.index
        )
        self.worker = BlockWorker(self.mover, remote=self.remote, slot_bytes=slot_bytes if self.remote else 0)
        # engine memory: a free list (least recently freed first), reference counts, the prefix cache
        self.free: deque[int] = deque(range(n))
        self.refs = [0] * n
        self.cached: dict[bytes, int] = {}  # block hash -> the block holding it
        self.hash_of: dict[int, bytes] = {}
        self.expect: dict[int, Bytes] = {}  # block -> the token slots it must hold now
        # requests
        self.live: dict[RequestId, _Request] = {}
        self.waiting: list[RequestId] = []
        self.running: list[RequestId] = []  # loading or running, in admission order
        self.ended: dict[RequestId, list[int]] = {}  # finish/abort said "delay": blocks kept until named
        self.arrivals: list[tuple[int, _Request]] = []
        self.chats = itertools.count()
        self.ops: dict[int, BlockOp] = {}  # handed to the worker, not reported yet
        self.fenced: set[int] = set()  # ops of a preempted admission: their blocks are no longer its own
        self.saving: dict[int, tuple[Bytes, ...]] = {}  # save op -> the bytes of each block it reads
        self.prefixes: list[list[int]] = [
            [],
            *([self.rng.randrange(1, VOCAB) for _ in range(k)] for k in (9, 16, 30)),
        ]
        # the oracle: token slots by key (a memo), and where known bytes came from (for the error messages)
        self.contents: dict[bytes, Bytes] = {}
        self.origin: OrderedDict[bytes, str] = OrderedDict()  # fingerprint of bytes -> where they came from
        self.shadow: dict[tuple[int, bytes], bytes] = {}  # (epoch, block hash) -> fingerprint at save
        self.stall: contextlib.ExitStack | None = None
        self.stall_until = 0
        self._known(np.zeros_like(self.kv[:, 0]), "zeros (never written)")
        self._known(np.full_like(self.kv[:, 0], POISON), "the store's POISON (a failed fetch)")

    # -- the run ---------------------------------------------------------------------------------------

    def run(self) -> FuzzSummary:
        try:
            for step in range(self.steps):
                self.clock.step = step
                self._step()
            self._drain()
        finally:
            if self.stall is not None:
                self.stall.close()
            self.sched.close()
            self.cpu.close()
        s = self.summary
        s.steps = self.steps
        s.mover_faults = self.mover.failed
        s.remote_faults = self.remote.failed if self.remote else 0
        s.late_jobs = self.mover.late + (self.remote.late if self.remote else 0)
        s.lookup_faults = self.index.failures if self.index else 0
        s.evictions = self.sched.stats().pool.evictions
        s.halted_at = self.mover.closed_at
        return s

    def _step(self) -> None:
        """One engine step. Freed blocks are reused only after a flush (``execute(take_plan())``), and the
        forward pass reads only blocks whose loads were awaited and checked."""
        self._weather()
        self._arrive()
        self._disrupt()
        self._make_room()
        self._flush()
        self._grow()
        self._admit()
        self._flush()
        self._forward()
        self._flush()
        self._finish_done()

    def _drain(self) -> None:
        """End every request, then run flushes until nothing is in flight; then nothing may be left."""
        if self.stall is not None:
            self.stall.close()
            self.stall = None
        for req in list(self.live.values()):
            self._end(req, finish=req.state is _State.RUNNING)
        for _ in range(DRAIN_STEPS):
            self.clock.step += 1
            self._flush()
            if not self.ops and not self.ended and not self._held():
                break
        else:
            self._fail(
                None,
                f"not quiescent after {DRAIN_STEPS} steps of draining: ops {sorted(self.ops)} unreported, "
                f"requests {sorted(self.ended)} never named by take_finished",
            )
        stats = self.sched.stats()
        pool = stats.pool
        left = {
            "requests": stats.requests,
            "ops in flight": stats.ops_in_flight,
            "pinned": pool.pinned,
            "storing": pool.storing,
            "slots neither free nor ready": pool.used - pool.ready,
            "engine blocks in use": sum(1 for r in self.refs if r),
        }
        leaks = {k: v for k, v in left.items() if v}
        if leaks:
            self._fail(None, f"at quiescence the scheduler still holds {leaks}")

    def _ops_of(self, rid: str) -> list[BlockOp]:
        """The request's ops in flight on its current blocks (not fenced by a preemption)."""
        return [op for i, op in self.ops.items() if op.request_id == rid and i not in self.fenced]

    def _held(self) -> int:
        return self.mover.held() + (self.remote.held() if self.remote else 0)

    # -- kvcore's protocol -----------------------------------------------------------------------------

    def _flush(self) -> None:
        """``execute(take_plan())``, await this plan's loads, hand every report to ``complete``, then take
        load errors and finished requests; settle loads that are fully reported; check."""
        plan = self.sched.take_plan()
        for op in plan.ops:
            self._note(_op(op))
            self._check_op(op)
            self.ops[op.op_id] = op
        self.worker.execute(plan)
        loads = plan.op_ids(Direction.LOAD)
        reports = self.worker.wait(loads, WAIT_S) if loads else self.worker.reports()
        if self.mover.refused:
            self._fail(None, f"the mover refused a copy kvcore planned: {self.mover.refused[0]}")
        for report in reports:
            self._reported(report)
        self.sched.complete(reports)
        self._take_load_errors()
        late = dict.fromkeys(self.ops[op].request_id for op in loads if op in self.ops)
        for rid in late:
            self._late_load(self.live[RequestId(rid)])
        for rid in self.sched.take_finished():
            self._note(f"take_finished -> {rid}")
            self._release(rid)
        for rid in self.running:
            req = self.live[rid]
            if req.state is _State.LOADING and not req.load_ops:
                self._settle(req)
        self._check_memory()
        self._check_counts()

    def _take_load_errors(self) -> None:
        for rid, blocks in self.sched.take_load_errors().items():
            self._note(f"take_load_errors {rid}: {list(blocks)}")
            req = self.live.get(rid)
            if req is None or req.gave_up:
                continue  # ended, or already recomputing the whole load
            if req.state is not _State.LOADING:
                self._fail(rid, f"take_load_errors named blocks {list(blocks)} after its load was settled")
            req.errors.update(blocks)

    def _late_load(self, req: _Request) -> None:
        """A load not reported after the wait: the engine either holds the request back until it is, or
        (rule 4 of the contract) gives it up: it fences the load (``worker.fence``: nothing writes the
        blocks any more) and recomputes the blocks now."""
        recompute = self.rng.random() < 0.5 and self.options.recompute_late
        self._note(
            f"load of {req.rid} late: {'fence it and recompute now' if recompute else 'hold the request'}"
        )
        if not recompute:
            return
        self.worker.fence(sorted(req.load_ops))
        req.gave_up = True
        req.state = _State.RUNNING
        req.computed = req.promised.start * BLOCK_TOKENS
        self.summary.loads_given_up += 1

    def _reported(self, report: OpReport) -> None:
        op = self.ops.pop(report.op_id, None)
        self.fenced.discard(report.op_id)
        failed = f" failed {list(report.failed)}" if report.failed else ""
        self._note(f"report #{report.op_id}{failed}{' ' + report.error if report.error else ''}")
        if op is None:
            self._fail(None, f"the worker reported op {report.op_id}, which is not in flight")
        req = self.live.get(RequestId(op.request_id))
        if req is not None:
            req.load_ops.discard(op.op_id)
        for i, want in enumerate(self.saving.pop(op.op_id, ())):
            slot_block = self.host_kv[op.host_blocks[i]]
            if i not in report.failed and not np.array_equal(slot_block, want):
                self._fail(
                    op.request_id,
                    f"save {op.op_id} reported host block {op.host_blocks[i]} (from engine block "
                    f"{op.engine_blocks[i]}) stored, but it holds {self._whose(slot_block)}; "
                    f"expected {self._whose(want)}",
                )

    def _check_op(self, op: BlockOp) -> None:
        """A load writes only blocks its request's load covers; a save reads only blocks it computed."""
        req = self.live.get(RequestId(op.request_id))
        if op.direction is Direction.LOAD:
            if req is None or req.state is not _State.LOADING:
                self._fail(op.request_id, f"load {op.op_id} planned for a request that is not loading")
            allowed = {req.blocks[j] for j in req.promised}
            what = "outside the blocks its lookup offered"
            req.load_ops.add(op.op_id)
        else:
            if req is None or req.state is not _State.RUNNING:
                self._fail(op.request_id, f"save {op.op_id} planned for a request that is not running")
            allowed = set(req.blocks[: req.computed // BLOCK_TOKENS])
            what = "that the request has not computed"
            self.saving[op.op_id] = tuple(self.expect[b] for b in op.engine_blocks if b in allowed)
        stray = [b for b in op.engine_blocks if b not in allowed]
        if stray:
            self._fail(op.request_id, f"{op.direction.value} {op.op_id} touches engine blocks {stray} {what}")

    def _lookup(self, req: _Request, local: int) -> int | None:
        rid = req.rid
        if req.chat.by_hashes:
            full = req.hashes[: len(req.tokens) // BLOCK_TOKENS]
            hits = self.sched.lookup(
                rid,
                block_hashes=full,
                hash_block_tokens=BLOCK_TOKENS,
                num_tokens=len(req.tokens),
                local_tokens=local,
                extra=ExtraKeys(cache_salt=req.chat.salt),
            )
            self._note(f"lookup {rid} block_hashes[{len(full)}] of {len(req.tokens)} local={local} -> {hits}")
        else:
            hits = self.sched.lookup(
                rid, tokens=req.tokens, local_tokens=local, extra=ExtraKeys(cache_salt=req.chat.salt)
            )
            self._note(f"lookup {rid} tokens[{len(req.tokens)}] salt={req.chat.salt} local={local} -> {hits}")
        req.looked_up = True
        if hits is None:
            return None
        self.summary.lookups += 1
        self.summary.hash_lookups += req.chat.by_hashes
        if hits < 0 or hits % BLOCK_TOKENS or local + hits >= len(req.tokens):
            self._fail(
                rid, f"lookup offered {hits} tokens beyond {local} of a {len(req.tokens)}-token prompt"
            )
        return hits

    def _save(self, req: _Request) -> None:
        if req.chat.by_hashes:
            saved = self.sched.save(
                req.rid,
                req.blocks,
                num_tokens=req.computed,
                block_hashes=req.hashes,
                hash_block_tokens=BLOCK_TOKENS,
            )
        else:
            saved = self.sched.save(req.rid, req.blocks, num_tokens=req.computed, tokens=req.tokens)
        self._note(f"save {req.rid} e{req.blocks} num_tokens={req.computed} -> {saved}")
        self.summary.saved_chunks += saved
        full = req.computed // BLOCK_TOKENS
        for j in range(req.shadowed, full):
            self.shadow[(req.epoch, req.hashes[j])] = _fingerprint(self.kv[:, req.blocks[j]])
        req.shadowed = max(req.shadowed, full)

    def _end(self, req: _Request, *, finish: bool) -> None:
        """Finish or abort; "delay" keeps the blocks until ``take_finished`` names the request."""
        rid = req.rid
        delay = self.sched.finish(rid) if finish else self.sched.abort(rid)
        verb = "finish" if finish else "abort"
        self._note(f"{verb} {rid} ({req.state.value}) -> {delay}")
        busy = self._ops_of(rid)
        if busy and not delay:
            self._fail(
                rid,
                f"{verb} said its blocks are free while {busy[0].direction.value} {busy[0].op_id} "
                "is in flight",
            )
        del self.live[rid]
        (self.waiting if req.state is _State.WAITING else self.running).remove(rid)
        if delay:
            self.ended[rid] = req.blocks
        else:
            self._free(req.blocks)
        if finish:
            self.summary.finished += 1
        else:
            self.summary.aborted += 1

    def _release(self, rid: RequestId) -> None:
        blocks = self.ended.pop(rid, None)
        if blocks is None:
            self._fail(rid, "take_finished named a request whose end was not delayed, or named it twice")
        busy = [op.op_id for op in self._ops_of(rid)]
        if busy:
            self._fail(rid, f"take_finished named it while its ops {busy} are in flight")
        self._free(blocks)

    def _preempt(self, req: _Request) -> None:
        """Preempt (load errors taken first, as the contract asks): its blocks are freed at once, first in
        line for the next allocation; its copies in flight are fenced by the next plan."""
        self._take_load_errors()
        self.sched.preempt(req.rid)
        self._note(f"preempt {req.rid} ({req.state.value}) e{req.blocks}")
        self._free(req.blocks, front=True)
        self.fenced.update(op for op, o in self.ops.items() if o.request_id == req.rid)
        req.blocks, req.computed, req.shadowed, req.gave_up = [], 0, 0, False
        req.state, req.promised, req.errors, req.load_ops = _State.WAITING, range(0), set(), set()
        self.running.remove(req.rid)
        self.waiting.insert(0, req.rid)
        self.summary.preemptions += 1

    # -- the engine's scheduling -----------------------------------------------------------------------

    def _weather(self) -> None:
        """The remote index stalls for a few steps, or fails its next answer."""
        if self.index is None or not self.options.faults:
            return
        if self.stall is not None and self.clock.step >= self.stall_until:
            self.stall.close()
            self.stall = None
        if self.stall is None and self.rng.random() < P_STALL:
            self.stall = contextlib.ExitStack()
            self.stall.enter_context(self.index.inner.stall())
            self.stall_until = self.clock.step + self.rng.randint(1, 4)
            self.summary.index_stalls += 1
        if self.rng.random() < P_LOOKUP_FAIL:
            self.index.inject_failure()

    def _arrive(self) -> None:
        due = [req for step, req in self.arrivals if step <= self.clock.step]
        self.arrivals = [(step, req) for step, req in self.arrivals if step > self.clock.step]
        if self.rng.random() < P_NEW_CHAT and len(self.live) + len(due) < MAX_LIVE:
            salt = self.rng.choice((None, None, "alpha", "beta"))
            chat = _Chat(next(self.chats), salt, self.rng.random() < 0.4, self.rng.randint(1, 4))
            due.append(self._request(chat, 0, [*self.rng.choice(self.prefixes), *self._text(1, 24)]))
        for req in due:
            self.live[req.rid] = req
            self.waiting.append(req.rid)
            self.summary.requests += 1

    def _request(self, chat: _Chat, turn: int, tokens: list[int]) -> _Request:
        rid = RequestId(f"c{chat.number}.t{turn}")
        req = _Request(rid, chat, turn, self.rng.random() < 0.5, tokens, self.rng.randint(0, 8))
        self._extend_hashes(req)
        return req

    def _text(self, low: int, high: int) -> list[int]:
        return [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(low, high))]

    def _disrupt(self) -> None:
        """Aborts at any point, preemptions of running requests, resets."""
        if self.live and self.rng.random() < P_ABORT:
            self._end(self.rng.choice(list(self.live.values())), finish=False)
        if self.options.preempt and self.running and self.rng.random() < P_PREEMPT:
            self._preempt(self.live[self.rng.choice(self.running)])
        if self.options.reset and self.rng.random() < P_RESET:
            self._reset()

    def _reset(self) -> None:
        """A reset as after a weight update: every request holding blocks is preempted (it recomputes
        under the new epoch; its copies in flight are fenced), then ``reset``."""
        for rid in list(self.running):
            self._preempt(self.live[rid])
        self.sched.reset()
        self._note("reset")
        self.epoch += 1
        self.cached.clear()
        for block in self.hash_of:
            if not self.refs[block]:
                self.expect.pop(block, None)
        self.hash_of.clear()
        self.shadow.clear()
        self.summary.resets += 1

    def _make_room(self) -> None:
        """Preempt the latest admitted running requests until every decode has a block for its next token."""
        while True:
            running = [self.live[r] for r in self.running if self.live[r].state is _State.RUNNING]
            needed = sum(1 for req in running if self._short(req))
            if needed <= len(self.free) or not running:
                return
            self._preempt(running[-1])

    def _short(self, req: _Request) -> bool:
        return len(req.tokens) > len(req.blocks) * BLOCK_TOKENS

    def _grow(self) -> None:
        for rid in self.running:
            req = self.live[rid]
            if req.state is _State.RUNNING and self._short(req):
                req.blocks.append(self._fresh(rid))

    def _admit(self) -> None:
        """Admit waiting requests in order while blocks last: engine prefix hit, lookup, allocation, load."""
        for rid in list(self.waiting):
            req = self.live[rid]
            local = self._local_hits(req)
            hits = self._lookup(req, local * BLOCK_TOKENS)
            if hits is None:
                continue  # the remote lookup is pending: ask again next step
            shared = [self.cached[req.hashes[j]] for j in range(local)]
            need = -(-len(req.tokens) // BLOCK_TOKENS) - local
            if need > len(self.free) - sum(1 for b in shared if not self.refs[b]):
                return
            for block in shared:
                if not self.refs[block]:
                    self.free.remove(block)
                self.refs[block] += 1
            req.blocks = shared + [self._fresh(rid) for _ in range(need)]
            req.computed = local * BLOCK_TOKENS
            req.epoch = self.epoch
            self.waiting.remove(rid)
            self.running.append(rid)
            req.state = _State.RUNNING
            if hits:
                queued = self.sched.start_load(rid, req.blocks)
                self._note(f"start_load {rid} e{req.blocks} -> {queued}")
                if queued < 0 or queued % BLOCK_TOKENS or queued > hits:
                    self._fail(rid, f"start_load queued {queued} tokens of the {hits} lookup offered")
                req.state = _State.LOADING
                req.promised = range(local, local + hits // BLOCK_TOKENS)
                req.queued = queued // BLOCK_TOKENS
                req.errors, req.load_ops = set(), set()

    def _local_hits(self, req: _Request) -> int:
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

    def _settle(self, req: _Request) -> None:
        """A load whose ops are all reported: every block the lookup offered either loaded the request's
        own bytes or was reported for recompute; the engine recomputes from the first reported block."""
        mine = {req.blocks[j]: j for j in req.promised}
        stray = sorted(req.errors - mine.keys())
        if stray:
            self._fail(
                req.rid, f"take_load_errors named engine blocks {stray}, outside its load {req.promised}"
            )
        unreported = [
            b for b in req.blocks[req.promised.start + req.queued : req.promised.stop] if b not in req.errors
        ]
        if unreported:
            self._fail(
                req.rid,
                f"start_load queued {req.queued} of the {len(req.promised)} blocks lookup offered, but "
                f"take_load_errors never named engine blocks {unreported}",
            )
        bad = sorted(mine[b] for b in req.errors)
        for j in req.promised:
            if req.blocks[j] not in req.errors:
                self._verify_loaded(req, j)
        stop = bad[0] if bad else req.promised.stop
        served = (stop - req.promised.start) * BLOCK_TOKENS
        extra = self.sched.extra_cached_tokens(req.rid)
        if extra != served:
            self._fail(
                req.rid, f"extra_cached_tokens says {extra}, but {served} tokens loaded before a failure"
            )
        for j in range(req.promised.start, stop):
            self._record(req, j, (j + 1) * BLOCK_TOKENS)
        req.computed = stop * BLOCK_TOKENS
        req.state = _State.RUNNING
        self.summary.loads_checked += 1
        self.summary.blocks_verified += len(req.promised) - len(bad)
        self.summary.blocks_recomputed += len(bad)

    def _forward(self) -> None:
        """The forward pass under a token budget (chunked prefill), decode sampling one token, then saves."""
        budget = self.rng.choice((4, 8, 16, 32))
        for rid in self.running:
            req = self.live[rid]
            if req.state is not _State.RUNNING or budget == 0:
                continue
            todo = min(len(req.tokens) - req.computed, budget)
            budget -= todo
            self._compute(req, req.computed + todo)
            if req.computed == len(req.tokens) and req.outputs_left:
                req.tokens.append(self.rng.randrange(1, VOCAB))
                req.outputs_left -= 1
                self._extend_hashes(req)
            self._save(req)

    def _finish_done(self) -> None:
        for rid in list(self.running):
            req = self.live[rid]
            if req.state is _State.RUNNING and req.computed == len(req.tokens):
                self._end(req, finish=True)
                self._next_turn(req)

    def _next_turn(self, req: _Request) -> None:
        """The chat goes on: a new request whose prompt is the whole conversation plus new text."""
        tokens = req.tokens + self._text(1, 12)
        if req.turn + 1 < req.chat.turns and len(tokens) + 8 <= MAX_TOKENS:
            nxt = self._request(req.chat, req.turn + 1, tokens)
            self.arrivals.append((self.clock.step + self.rng.randint(1, 4), nxt))

    # -- engine memory ---------------------------------------------------------------------------------

    def _fresh(self, rid: str) -> int:
        """A block off the free list, dropped from the prefix cache and filled with recognisable poison."""
        block = self.free.popleft()
        cached = self.hash_of.pop(block, None)
        if cached is not None:
            del self.cached[cached]
        self.refs[block] = 1
        self.expect.pop(block, None)
        self._scribble(
            self.kv[:, block], f"poison of engine block {block} given to {rid} at step {self.clock.step}"
        )
        return block

    def _free(self, blocks: Sequence[int], *, front: bool = False) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            if block not in self.hash_of:
                self.expect.pop(block, None)  # not in the prefix cache: its bytes no longer matter
            if front:
                self.free.appendleft(block)
            else:
                self.free.append(block)

    def _compute(self, req: _Request, upto: int) -> None:
        """The forward pass writes the KV of tokens ``[computed, upto)``: their token slots, nothing else."""
        for j in range(req.computed // BLOCK_TOKENS, -(-upto // BLOCK_TOKENS)):
            slots = self._record(req, j, min(upto, (j + 1) * BLOCK_TOKENS))
            first = max(req.computed - j * BLOCK_TOKENS, 0)
            self.kv[:, req.blocks[j], :, first : slots.shape[2]] = slots[:, :, first:]
        req.computed = upto

    def _record(self, req: _Request, j: int, upto: int) -> Bytes:
        """Block ``j`` of the request holds the KV of its tokens before ``upto`` from now on (what its other
        slots hold does not matter); a full block enters the prefix cache."""
        slots = self._slots(req, j, upto)
        block = req.blocks[j]
        self.expect[block] = slots
        if upto == (j + 1) * BLOCK_TOKENS and req.hashes[j] not in self.cached and block not in self.hash_of:
            self.cached[req.hashes[j]] = block
            self.hash_of[block] = req.hashes[j]
        return slots

    def _spoil(self, direction: Direction, block: int, why: str) -> None:
        """What a failed copy leaves in its destination: an engine block (load) or a host block (save)."""
        self._scribble(self.kv[:, block] if direction is Direction.LOAD else self.host_kv[block], why)

    def _scribble(self, target: Bytes, why: str) -> None:
        data = np.frombuffer(hashlib.shake_128(why.encode()).digest(target.size), dtype=np.uint8)
        target[...] = data.reshape(target.shape)
        self._known(target, why)

    # -- the oracle ------------------------------------------------------------------------------------

    def _extend_hashes(self, req: _Request) -> None:
        """The engine's chained block hashes (salt in the root), as vLLM keys its prefix cache."""
        while len(req.hashes) < len(req.tokens) // BLOCK_TOKENS:
            j = len(req.hashes)
            parent = req.hashes[-1] if req.hashes else req.chat.root
            block = req.tokens[j * BLOCK_TOKENS : (j + 1) * BLOCK_TOKENS]
            req.hashes.append(hashlib.sha256(parent + _pack(block)).digest())

    def _slots(self, req: _Request, j: int, upto: int) -> Bytes:
        """The KV of block ``j``'s tokens before ``upto``, ``[layer, head, slot, bytes]``: the KV of a
        token is a function of the epoch and of everything before it (its chain: salt and tokens)."""
        base = struct.pack("<I", req.epoch) + (req.hashes[j - 1] if j else req.chat.root)
        tokens = req.tokens[j * BLOCK_TOKENS : upto]
        key = hashlib.sha256(base + _pack(tokens)).digest()
        slots = self.contents.get(key)
        if slots is None:
            if len(self.contents) >= 1 << 14:
                self.contents.clear()  # a memo: nothing else holds its keys
            layers, _, heads, _, width = self.kv.shape
            size = layers * heads * width
            each = [hashlib.shake_128(base + _pack(tokens[: t + 1])).digest(size) for t in range(len(tokens))]
            raw = np.frombuffer(b"".join(each), dtype=np.uint8).reshape(len(tokens), layers, heads, width)
            slots = self.contents[key] = raw.transpose(1, 2, 0, 3)
            self._known(
                slots, f"{req.rid} block {j} (tokens before {upto}, salt {req.chat.salt}, epoch {req.epoch})"
            )
        return slots

    def _known(self, data: Bytes, origin: str) -> None:
        fingerprint = _fingerprint(data)
        if fingerprint not in self.origin:
            self.origin[fingerprint] = origin
            if len(self.origin) > 1 << 16:
                self.origin.popitem(last=False)

    def _whose(self, block: Bytes) -> str:
        """Where a block's bytes came from, as far as known: the longest run of leading slots known."""
        for n in range(block.shape[2], 0, -1):
            origin = self.origin.get(_fingerprint(block[:, :, :n]))
            if origin is not None:
                return origin if n == block.shape[2] else f"{origin} in its first {n} slots"
        return "bytes of unknown origin"

    def _verify_loaded(self, req: _Request, j: int) -> None:
        block = req.blocks[j]
        got = self.kv[:, block]
        want = self._slots(req, j, (j + 1) * BLOCK_TOKENS)
        where = f"loaded block {j} (engine block {block}, salt {req.chat.salt}, epoch {req.epoch})"
        if not np.array_equal(got, want):
            self._fail(req.rid, f"{where} holds {self._whose(got)}; expected {self._whose(want)}")
        shadow = self.shadow.get((req.epoch, req.hashes[j]))
        if shadow is None:
            self._fail(req.rid, f"{where}: no request handed a block of these tokens to save in this epoch")
        if shadow != _fingerprint(got):
            self._fail(req.rid, f"{where} differs from the bytes handed to save")

    # -- checks ----------------------------------------------------------------------------------------

    def _check_memory(self) -> None:
        """Every block the engine relies on (held, or in its prefix cache) holds the KV it computed or
        loaded in every slot it computed or loaded: no copy wrote into them since."""
        for block, want in self.expect.items():
            got = self.kv[:, block]
            if not np.array_equal(got[:, :, : want.shape[2]], want):
                owners = [r for r, req in self.live.items() if block in req.blocks]
                owners += [r for r, blocks in self.ended.items() if block in blocks]
                self._fail(
                    owners[0] if owners else None,
                    f"engine block {block} (held by {owners or 'the prefix cache'}) changed under the "
                    f"engine: holds {self._whose(got)}; expected {self._whose(want)}",
                )

    def _check_counts(self) -> None:
        stats = self.sched.stats()
        if stats.ops_in_flight != len(self.ops):
            self._fail(
                None, f"the scheduler counts {stats.ops_in_flight} ops in flight, the worker {len(self.ops)}"
            )
        known = sum(1 for req in self.live.values() if req.looked_up) + len(self.ended)
        if stats.requests != known:
            self._fail(None, f"the scheduler tracks {stats.requests} requests, the engine expects {known}")
        pool = stats.pool
        if not pool.ready + pool.storing <= pool.used <= pool.capacity:
            self._fail(None, f"pool usage is inconsistent: {pool}")

    def _note(self, line: str) -> None:
        self.trace.append(f"s{self.clock.step} {line}")

    def _fail(self, request: str | None, detail: str) -> NoReturn:
        step = self.clock.step
        steps = min(self.steps, step + 1)
        replay = " ".join(
            filter(None, ["kvcore fuzz", f"--seed {self.seed} --steps {steps}", self.options.flags()])
        )
        raise FuzzFailure(self.seed, step, request, detail, replay, self.trace)
