"""``TorchBlockMover``: the ``BlockMover`` port over torch tensors, for CPU and CUDA engines.

``submit`` checks the block ids on the caller's thread, so that wrong ids raise before anything is
copied, then hands the job to a lane and returns: a worker thread for a CPU engine (``cpu_lane`` running
``cpu_copy``), one copy stream per direction for a CUDA engine (``cuda_lane``). Both report to one
``JobBoard``, which ``poll`` and ``wait`` read. A closed mover opens a fresh lane on ``reopen`` once every
job of the old one has ended (``kvcore.ports.SupportsReopen``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np

from kvcore.checks import is_int_in
from kvcore.errors import ConfigError, InvalidSpecError, UnsupportedConfiguration, UsageError
from kvcore.ids import JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.kit.faults import FaultHooks
from kvcore.model.head_runs import HeadRuns
from kvcore.ports import BlockTransfer, Direction
from kvcore_cpu.cpu_copy import BlockCopier
from kvcore_cpu.cpu_lane import CpuLane
from kvcore_cpu.cuda_lane import CudaLane
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.rows import IntArray, head_routes, routes

__all__ = ["MAX_COPY_THREADS", "TorchBlockMover", "head_runs"]

MAX_COPY_THREADS = 64
"""Most threads one CPU copy may use: more than the memory channels of a socket can feed only contend."""


class _Lane(Protocol):
    def start(
        self,
        job_id: JobId,
        direction: Direction,
        engine_ids: IntArray,
        host_ids: IntArray,
        after: object,
        which: int = 0,
    ) -> None: ...

    def mark(self) -> object: ...

    def wait_loaded(self, job_id: JobId, timeout: float) -> None: ...

    def close(self, timeout: float) -> None: ...


class TorchBlockMover:
    """Copies whole blocks between the registered engine KV tensors and host memory.

    ``copy_threads`` is how many threads a CPU copy uses (the worker and its helpers); CUDA copies run
    on the device's copy engines and ignore it. Every job whose id ``submit`` returns gets exactly one
    result; a refused submit raises and leaves no job behind.
    """

    def __init__(
        self,
        engine: EngineKV,
        host: HostMemory,
        *,
        copy_threads: int = 2,
        faults: FaultHooks | None = None,
        per_head: bool = False,
    ) -> None:
        """``faults`` (``kvcore.kit.faults``): ``before_queue`` runs in ``submit``, ``before_transfer`` on the
        worker thread before each copy, of a CPU engine. ``per_head``: host blocks are head blocks (one
        local KV head's runs of a host block, ``kvcore.model.head_runs``) and every transfer names its
        head (``BlockTransfer.head``); ``InvalidSpecError`` where the engine's heads are not runs.

        Raises ``InvalidSpecError`` for an ``engine`` or ``host`` of the wrong type or host blocks of
        the wrong size, ``UsageError`` for closed host memory, ``ConfigError`` for ``copy_threads``
        outside ``[1, MAX_COPY_THREADS]``, ``UnsupportedConfiguration`` for a device other than CPU or
        CUDA, or ``faults`` on a CUDA engine (its copies run on streams, with no thread to hook)."""
        if not isinstance(engine, EngineKV):
            raise InvalidSpecError(f"engine: got {type(engine).__name__}, expected an EngineKV (register it)")
        if not isinstance(host, HostMemory):
            raise InvalidSpecError(f"host: got {type(host).__name__}, expected a HostMemory")
        if host.closed:
            raise UsageError("host: the host memory is closed")
        heads = head_runs(engine, per_head=per_head)
        block_bytes = engine.host_block_bytes if heads is None else heads.head_bytes
        if host.block_bytes != block_bytes:
            whose = "one block" if heads is None else "one KV head's bytes of one block"
            raise InvalidSpecError(
                f"host memory: block_bytes: got {host.block_bytes}, expected {block_bytes} "
                f"({whose} of each of the engine's {engine.num_layers} layers)"
            )
        if not is_int_in(copy_threads, 1, MAX_COPY_THREADS):
            raise ConfigError("copy_threads", copy_threads, f"an int in [1, {MAX_COPY_THREADS}]")
        self._engine_blocks = engine.num_blocks
        self._host_blocks = host.num_blocks
        self._board = JobBoard()
        self._lock = threading.Lock()
        self._closed = False
        self._copier: BlockCopier | None = None
        self._faults = faults
        device = engine.device
        if device.type not in ("cpu", "cuda"):
            raise UnsupportedConfiguration(f"engine device: got {device}, expected cpu or cuda")
        if device.type == "cuda" and faults is not None:
            raise UnsupportedConfiguration(f"faults: got {faults!r}, expected None on a CUDA engine")
        self._device = device
        self._heads = 0 if heads is None else heads.heads
        self._route_sets = (
            (routes(engine),) if heads is None else tuple(head_routes(engine, runs) for runs in heads.runs)
        )
        self._host = host
        self._copy_threads = copy_threads
        self._lane = self._open_lane()

    def _open_lane(self) -> _Lane:
        if self._device.type == "cuda":
            return CudaLane(self._route_sets, self._host, self._board, self._device)
        self._copier = BlockCopier(self._route_sets, self._host, self._copy_threads)
        return CpuLane(self._board, self._copier, self._faults)

    def submit(self, transfer: BlockTransfer) -> JobId:
        """Queue a copy and return at once.

        Raises ``InvalidSpecError`` (nothing copied, no job) for a direction that is not a ``Direction``,
        block ids that are not integers or lie out of range, lists of different lengths or a destination
        block listed twice; ``UsageError`` once the mover is closed. A copy that fails later, or cannot
        even be queued (a device error), is a failed result: the destination blocks hold undefined bytes.
        """
        return self.submit_after(transfer, self._lane.mark())

    def mark(self) -> object:
        """The engine's queued work seen from this thread: a CUDA event on its current stream (``None``
        on a CPU engine, whose work is done when it calls kvcore)."""
        return self._lane.mark()

    def submit_after(self, transfer: BlockTransfer, mark: object) -> JobId:
        """``submit``, with the copy ordered after ``mark`` (taken by ``mark`` on the engine's thread)
        instead of after the calling thread's queued work."""
        if not isinstance(transfer, BlockTransfer):
            raise InvalidSpecError(f"transfer: got {type(transfer).__name__}, expected a BlockTransfer")
        direction: object = transfer.direction
        if not isinstance(direction, Direction):
            raise InvalidSpecError(f"direction: got {direction!r}, expected a Direction")
        which = self._which(transfer.head)
        engine_ids = _ids("engine_blocks", transfer.engine_blocks, self._engine_blocks)
        host_ids = _ids("host_blocks", transfer.host_blocks, self._host_blocks)
        if len(engine_ids) != len(host_ids):
            raise InvalidSpecError(
                f"host_blocks has {len(host_ids)} entries, engine_blocks {len(engine_ids)}: expected equal"
            )
        if direction is Direction.SAVE:
            _check_unique("host_blocks", host_ids)
        else:
            _check_unique("engine_blocks", engine_ids)
        with self._lock:
            if self._closed:
                raise UsageError("the mover is closed")
            job_id = self._board.new()
            if not len(engine_ids):
                self._board.finish(JobResult(job_id))
                return job_id
            try:
                if self._faults is not None:
                    self._faults.before_queue(direction, len(engine_ids))
                self._lane.start(job_id, direction, engine_ids, host_ids, mark, which)
            # A lane that refuses the job (closed) queued nothing, and an interrupt leaves no one to
            # report: the id is withdrawn, so that no wait on it hangs and no poll hands it out.
            except UsageError:
                self._withdraw(job_id)
                raise
            # Any other failure to queue (a device error) is the job's failure, as a failed copy is.
            except Exception as exc:
                self._board.finish(JobResult(job_id, _every(engine_ids), f"{type(exc).__name__}: {exc}"))
            except BaseException:
                self._withdraw(job_id)
                raise
        return job_id

    def _which(self, head: object) -> int:
        """The route set of a transfer's ``head``: a head mover's transfers name one of its heads, a
        whole-block mover's none."""
        if not self._heads:
            if head is not None:
                raise InvalidSpecError(f"head: got {head!r}, expected None (this mover moves whole blocks)")
            return 0
        if not is_int_in(head, 0, self._heads - 1):
            raise InvalidSpecError(f"head: got {head!r}, expected a local KV head in [0, {self._heads})")
        return head

    def poll(self) -> tuple[JobResult, ...]:
        # Under the lock that submit holds while it may withdraw a job: no poll sees a withdrawn result.
        with self._lock:
            return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        """Block until every job in ``job_ids`` finished, ``TransferTimeout`` after ``timeout`` seconds
        (``ConfigError`` unless a finite number >= 0: every wait is bounded)."""
        return self._board.wait(job_ids, _timeout(timeout))

    @property
    def orders_on_device(self) -> bool:
        """``SupportsDeviceOrder``: a CUDA engine's stream waits for loads on the GPU; a CPU engine's
        host waits."""
        return self._device.type == "cuda"

    def wait_loaded(self, job_id: JobId, timeout: float) -> None:
        """Order the engine after the load ``job_id``, without taking its result.

        CUDA: the current stream waits for the load's copies (the host does not block). CPU: blocks
        until the load is in place, ``TransferTimeout`` after ``timeout`` seconds (``ConfigError`` unless
        a finite number >= 0). Unknown or reported jobs return at once. A failed load still returns: its
        result says which blocks to recompute.
        """
        self._lane.wait_loaded(job_id, _timeout(timeout))

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking jobs, fail those not started, join the worker (at most ``timeout`` s). Idempotent.

        Every submitted job still gets a result through ``poll`` / ``wait``.
        """
        timeout = _timeout(timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lane, copier = self._lane, self._copier  # a ``reopen`` from now on makes new ones
        lane.close(timeout)
        if copier is not None:
            copier.close()

    def reopen(self) -> bool:
        """Take jobs again after ``close``, on a fresh lane, once every job submitted before has ended
        (``kvcore.ports.SupportsReopen``); returns whether it does. Raises ``UsageError`` once the host
        memory it copies to is closed."""
        with self._lock:
            if not self._closed:
                return True
            if self._board.in_flight():
                return False
            if self._host.closed:
                raise UsageError("reopen: the host memory is closed")
            self._lane = self._open_lane()
            self._closed = False
            return True

    def _withdraw(self, job_id: JobId) -> None:
        """Forget a job whose id was never handed out (with ``_lock`` held): finish it, take the result."""
        self._board.finish(JobResult(job_id))
        self._board.wait([job_id], 0.0)


def head_runs(engine: EngineKV, *, per_head: bool) -> HeadRuns | None:
    """The runs of each KV head of ``engine``'s host block for a mover of head blocks (``per_head``),
    else ``None``; ``InvalidSpecError`` where its heads are not runs of a block."""
    if not per_head:
        return None
    heads = HeadRuns.of_layout(engine.layout, engine.num_layers)
    if heads is None:
        raise InvalidSpecError(
            f"per_head: the engine's {engine.layout.num_kv_heads} KV heads are not runs of a block "
            f"({engine.layout.head_order.value.upper()})"
        )
    return heads


def _ids(name: str, values: Sequence[object], bound: int) -> IntArray:
    """Block ids as int64: each an integer (a NumPy one too; never a bool, float or string, which numpy
    would truncate or parse) in ``[0, bound)``, else ``InvalidSpecError`` naming ``name`` and the id.

    Checked a type and a range at a time (a job carries thousands of ids, and a check per id in Python
    cost more than copying its 16 KiB block); ids one by one only where that finds something to name."""
    kinds = set(map(type, values))
    if all(kind is not bool and issubclass(kind, int | np.integer) for kind in kinds):
        try:
            ids = np.array(values, dtype=np.int64).reshape(len(values))
        except OverflowError:
            pass
        else:
            if not len(ids) or (int(ids.min()) >= 0 and int(ids.max()) < bound):
                return ids
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise InvalidSpecError(f"{name}: got {value!r}, expected integer block ids")
        if not 0 <= value < bound:
            raise InvalidSpecError(f"{name}: block {value} is outside [0, {bound})")
    return np.fromiter(values, dtype=np.int64, count=len(values))


def _every(ids: IntArray) -> tuple[int, ...]:
    return tuple(range(len(ids)))


def _timeout(value: object) -> float:
    """``value`` in seconds, if it is a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ConfigError("timeout", value, "a finite number of seconds >= 0")
    return float(value)


def _check_unique(name: str, ids: IntArray) -> None:
    ordered = np.sort(ids)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated):
        raise InvalidSpecError(f"{name}: block {int(repeated[0])} is a destination twice in one job")
