"""``MooncakePeerTransport``: the ``PeerTransport`` port on Mooncake's ``TransferEngine`` (TCP or RDMA).

The producer of a prefill/decode pair pushes KV into the consumer's registered memory. ``submit_write``
checks the copies on the caller's thread (sources must lie in memory registered here, so a bad plan is
refused before a byte moves), coalesces ranges that touch on both sides, and queues the job. One worker
thread cuts jobs into native asynchronous batch writes of ``max_entries / 2`` copies, keeps at most
``max_entries`` copies in flight (Mooncake's TCP lanes reject entries beyond their queue: one batch of
4096 writes fails on loopback) and waits for the oldest batch first, so that the next batch travels while
one is waited on. Results go to a ``JobBoard``.

Native failures are return codes: a batch id of 0 (the peer could not be reached: its segment did not
open) or a status of -1 (the write failed, the peer rejected it, or Mooncake's own transfer timeout,
``MC_TRANSFER_TIMEOUT``, 30 s by default, ran out) fail every copy of the job.

A transport wraps a native engine (``start_engine``) and leaves nothing on it after ``close``, which
withdraws its registrations: the engine can then carry a new transport (tests reuse engines, which take
a second each to start).
"""

from __future__ import annotations

import collections
import logging
import queue
import re
import threading
from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvcore.config import PDConfig
from kvcore.errors import BackendUnavailable, ConfigError, InvalidSpecError, UsageError
from kvcore.ids import JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.ports import ByteCopy, MemoryRegion

__all__ = ["MooncakePeerTransport", "TransferEngineLike", "coalesce", "start_engine"]

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]

_PEER = re.compile(r"^[^\s:]+:\d{1,5}$")
_NO_BATCH = frozenset({0, -1, 2**64 - 1})  # versions differ: 0, or -1 as a signed or unsigned 64-bit id


class TransferEngineLike(Protocol):
    """The part of ``mooncake.engine.TransferEngine`` this transport calls (a fake can stand in)."""

    def get_rpc_port(self) -> int: ...

    def batch_register_memory(self, buffer_addresses: list[int], capacities: list[int]) -> int: ...

    def batch_unregister_memory(self, buffer_addresses: list[int], /) -> int: ...

    def batch_transfer_async_write(
        self, target_hostname: str, buffers: list[int], peer_buffer_addresses: list[int], lengths: list[int]
    ) -> int: ...

    def get_batch_transfer_status(self, batch_ids: list[int], /) -> int: ...


class _Job:
    """One write on the worker: its native batches go out in order (mutable, worker thread only)."""

    __slots__ = ("count", "done", "dsts", "error", "job_id", "lengths", "peer", "reported", "sent", "srcs")

    def __init__(
        self, job_id: JobId, peer: str, srcs: list[int], dsts: list[int], lengths: list[int], count: int
    ) -> None:
        self.job_id = job_id
        self.peer = peer
        self.srcs = srcs
        self.dsts = dsts
        self.lengths = lengths
        self.count = count  # copies as submitted, before coalescing: the indices a failure reports
        self.sent = 0  # entries handed to the engine
        self.done = 0  # entries whose batch ended
        self.error: str | None = None
        self.reported = False


def coalesce(srcs: IntArray, dsts: IntArray, lengths: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """Sort copies by source and merge neighbours that touch on both sides (same bytes, fewer entries)."""
    if len(srcs) < 2:
        return srcs, dsts, lengths
    order = np.argsort(srcs, kind="stable")
    srcs, dsts, lengths = srcs[order], dsts[order], lengths[order]
    joins = (srcs[:-1] + lengths[:-1] == srcs[1:]) & (dsts[:-1] + lengths[:-1] == dsts[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    ends = np.concatenate((starts[1:], [len(srcs)]))
    merged = srcs[ends - 1] + lengths[ends - 1] - srcs[starts]
    return srcs[starts], dsts[starts], merged


def start_engine(config: PDConfig) -> TransferEngineLike:
    """Start a transfer engine on ``config.host`` (peer-to-peer handshakes, no metadata server).

    Raises ``BackendUnavailable`` when the engine does not start (or Mooncake is not installed).
    """
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise BackendUnavailable(f"mooncake.engine cannot be imported: {exc}") from exc
    engine = TransferEngine()
    code = engine.initialize(config.host, "P2PHANDSHAKE", config.protocol, config.devices)
    if code != 0:
        raise BackendUnavailable(
            f"TransferEngine.initialize({config.host!r}, P2PHANDSHAKE, {config.protocol!r}, "
            f"{config.devices!r}) returned {code}"
        )
    return engine


def _column(values: Collection[int]) -> IntArray:
    """An int64 array of ``values``: the array itself when it is one already."""
    return np.asarray(values, dtype=np.int64)


def _merge(regions: Sequence[MemoryRegion]) -> list[tuple[int, int]]:
    """Regions as sorted ``(start, stop)`` spans, touching ones joined; ``InvalidSpecError`` on overlap."""
    merged: list[tuple[int, int]] = []
    for start, stop in sorted((r.address, r.address + r.length) for r in regions):
        if stop <= start:
            raise InvalidSpecError("every region needs a length of at least 1 byte")
        if merged and start < merged[-1][1]:
            raise InvalidSpecError(f"region at {start:#x} overlaps another one")
        if merged and start == merged[-1][1]:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged


class MooncakePeerTransport:
    """Writes local registered memory into a peer's registered memory through one ``TransferEngine``.

    Peers are named by the address their engine listens on (``address``: ``"host:rpc_port"``). Build it
    with ``open`` (a new engine) or over any started ``TransferEngineLike``.
    """

    def __init__(self, engine: TransferEngineLike, hostname: str, *, max_entries: int = 1024) -> None:
        if max_entries < 1:
            raise ConfigError("max_entries", max_entries, "at least 1")
        self._engine = engine
        self._max_entries = max_entries
        self._batch = max(1, max_entries // 2)
        self.address = f"{hostname}:{engine.get_rpc_port()}"
        self._board = JobBoard()
        self._lock = threading.Lock()
        self._regions: list[MemoryRegion] = []
        self._starts: IntArray = np.zeros(0, dtype=np.int64)
        self._stops: IntArray = np.zeros(0, dtype=np.int64)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kvcore-pd-transport", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, config: PDConfig) -> MooncakePeerTransport:
        """A transport on a new engine (``start_engine``). Raises ``BackendUnavailable`` as it does."""
        return cls(start_engine(config), config.host)

    # -- PeerTransport --------------------------------------------------------------------------------

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Make ``regions`` readable and writable by peers. Regions that touch are registered as one.

        Raises ``InvalidSpecError`` for an empty or overlapping region and ``BackendError`` when the
        engine refuses; either way nothing new is registered. ``UsageError`` after ``close``.
        """
        merged = _merge(regions)
        with self._lock:
            if self._closed:
                raise UsageError(f"register: transport {self.address} is closed")
            for start, stop in merged:
                if self._overlaps(start, stop):
                    raise InvalidSpecError(f"register: [{start:#x}, {stop:#x}) is already registered")
            code = self._engine.batch_register_memory([s for s, _ in merged], [e - s for s, e in merged])
            if code != 0:
                raise BackendUnavailable(f"TransferEngine.batch_register_memory returned {code}")
            self._set_regions([*self._regions, *(MemoryRegion(s, e - s) for s, e in merged)])

    def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        """Withdraw the registrations that ``regions`` cover (as passed to ``register``); others stay.

        The caller makes sure no job in flight reads them. Regions never registered are ignored, as are
        regions that could not be (empty or overlapping).
        """
        try:
            spans = _merge(regions)
        except InvalidSpecError:
            return
        with self._lock:
            self._withdraw(
                [
                    r
                    for r in self._regions
                    if any(start <= r.address and r.address + r.length <= stop for start, stop in spans)
                ]
            )

    def submit_write(self, peer: str, copies: Sequence[ByteCopy]) -> JobId:
        """Queue a write of local bytes into ``peer``'s registered memory; returns at once.

        Raises ``InvalidSpecError`` (nothing sent) for a peer name that is not ``host:port`` or a source
        outside the memory registered here, ``UsageError`` after ``close``. A write that fails later fails
        every copy of the job: the peer's destination bytes are undefined and must be recomputed.
        """
        return self.submit_write_columns(
            peer, [c.src for c in copies], [c.dst for c in copies], [c.length for c in copies]
        )

    def submit_write_columns(
        self, peer: str, srcs: Collection[int], dsts: Collection[int], lengths: Collection[int]
    ) -> JobId:
        """``submit_write`` with the copies as three columns; int64 arrays are taken without copying."""
        if not _PEER.match(peer):
            raise InvalidSpecError(f"peer: got {peer!r}, expected 'host:port' of a transfer engine")
        if not len(srcs) == len(dsts) == len(lengths):
            raise InvalidSpecError(
                f"srcs, dsts and lengths: got {len(srcs)}, {len(dsts)} and {len(lengths)} entries, "
                "expected columns of one length"
            )
        src, dst, length = _column(srcs), _column(dsts), _column(lengths)
        if len(length) and int(length.min()) < 1:
            raise InvalidSpecError("every copy needs a length of at least 1 byte")
        with self._lock:
            if self._closed:
                raise UsageError(f"submit_write: transport {self.address} is closed")
            self._check_sources(src, length)
            job_id = self._board.new()
        count = len(src)
        if not count:
            self._board.finish(JobResult(job_id))
            return job_id
        src, dst, length = coalesce(src, dst, length)
        self._queue.put(_Job(job_id, peer, src.tolist(), dst.tolist(), length.tolist(), count))
        return job_id

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking jobs; queued ones still run and report. Joins the worker for at most ``timeout``,
        then withdraws every registration. Idempotent.

        The engine itself stays up (it may carry a new transport) until the last reference to it goes.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("transport %s closing with writes still in flight after %.1fs", self.address, timeout)
        with self._lock:
            self._withdraw(self._regions)

    # -- internals -------------------------------------------------------------------------------------

    def _withdraw(self, gone: list[MemoryRegion]) -> None:
        """Unregister ``gone`` (registered here) from the engine (under the lock)."""
        if gone:
            self._engine.batch_unregister_memory([r.address for r in gone])
            self._set_regions([r for r in self._regions if r not in gone])

    def _set_regions(self, regions: list[MemoryRegion]) -> None:
        self._regions = sorted(regions, key=lambda r: r.address)
        self._starts = np.array([r.address for r in self._regions], dtype=np.int64)
        self._stops = np.array([r.address + r.length for r in self._regions], dtype=np.int64)

    def _overlaps(self, start: int, stop: int) -> bool:
        return any(r.address < stop and start < r.address + r.length for r in self._regions)

    def _check_sources(self, srcs: IntArray, lengths: IntArray) -> None:
        if not len(srcs):
            return
        at = np.searchsorted(self._starts, srcs, side="right") - 1
        inside = (at >= 0) & (srcs + lengths <= self._stops[np.maximum(at, 0)])
        if not inside.all():
            bad = int(np.flatnonzero(~inside)[0])
            raise InvalidSpecError(
                f"copy {bad}: source [{int(srcs[bad]):#x}, +{int(lengths[bad])}) is not in registered memory"
            )

    def _serve(self) -> None:
        """Submit batches while the copies in flight leave room; wait for the oldest; report jobs."""
        waiting: collections.deque[_Job] = collections.deque()
        in_flight: collections.deque[tuple[_Job, int, int]] = collections.deque()  # job, batch id, entries
        entries = 0
        stopping = False
        while not (stopping and not waiting and not in_flight):
            block = not waiting and not in_flight and not stopping
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                pass
            else:
                if job is None:
                    stopping = True
                else:
                    waiting.append(job)
                continue
            while (
                waiting
                and entries + min(len(waiting[0].srcs) - waiting[0].sent, self._batch) <= self._max_entries
            ):
                job = waiting[0]
                chunk = slice(job.sent, job.sent + self._batch)
                batch_id = self._start(job, chunk)
                job.sent = min(job.sent + self._batch, len(job.srcs))
                if batch_id in _NO_BATCH or job.sent == len(job.srcs):
                    waiting.popleft()
                in_flight.append((job, batch_id, len(job.srcs[chunk])))
                entries += len(job.srcs[chunk])
                if batch_id in _NO_BATCH:
                    break
            job, batch_id, count = in_flight.popleft()
            entries -= count
            error = self._status(job, batch_id)
            if error is not None and job.error is None:
                job.error = error
                if job in waiting:  # the job failed: its later batches are not sent
                    waiting.remove(job)
                    job.sent = len(job.srcs)
            job.done += count
            if job.done == len(job.srcs) or (job.error is not None and not _pending(in_flight, job)):
                self._report(job)

    def _start(self, job: _Job, chunk: slice) -> int:
        try:
            return self._engine.batch_transfer_async_write(
                job.peer, job.srcs[chunk], job.dsts[chunk], job.lengths[chunk]
            )
        # A binding error (bad argument types, a closed engine) fails this job, never the worker.
        except Exception as exc:
            log.warning("batch write to %s could not start: %s: %s", job.peer, type(exc).__name__, exc)
            return 0

    def _status(self, job: _Job, batch_id: int) -> str | None:
        """``None`` when the batch arrived, else why it did not."""
        if batch_id in _NO_BATCH:
            return f"peer {job.peer} is unreachable (segment did not open)"
        try:
            code = self._engine.get_batch_transfer_status([batch_id])
        except Exception as exc:  # as in _start: the job fails, the worker goes on
            return f"{type(exc).__name__}: {exc}"
        return None if code == 0 else f"batch write to {job.peer} failed (status {code})"

    def _report(self, job: _Job) -> None:
        if job.reported:
            return
        job.reported = True
        failed = () if job.error is None else tuple(range(job.count))
        self._board.finish(JobResult(job.job_id, failed, job.error))


def _pending(in_flight: collections.deque[tuple[_Job, int, int]], job: _Job) -> bool:
    return any(other is job for other, _, _ in in_flight)
