"""Block copies between a CUDA engine's KV memory and page-locked host memory, on copy streams.

Each direction has its own low-priority stream, so loads and saves overlap each other and the engine's
compute. A job is ordered after the work the engine had queued when it was submitted: the copy stream
waits on an event recorded on the submitting thread's current stream (for a save: after the compute that
wrote the blocks). Each job ends with an event: one reaper thread per direction waits on it (a blocking
event, so the thread sleeps instead of spinning) and reports the job; ``wait_loaded`` makes the engine's
stream wait on a load's event without blocking the host.

Blocks are moved in batches: one gather (or scatter) kernel per route into a staging buffer laid out as
host blocks, then one host copy per run of consecutive host blocks. Where an engine block is one run laid
out as a host block (one plane, or vLLM's cross-layer orders) and runs are long on both sides, the runs are
copied directly, with no staging.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import numpy as np
import torch
from attrs import frozen

from kvcore.ids import JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.ports import Direction
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.rows import IntArray, Route

__all__ = ["CudaLane", "stream_mark"]

_LOWEST_PRIORITY = 1 << 10
"""torch maps priorities past CUDA's range to the lowest one; copies never outrank the engine's compute."""

_STAGING_BYTES = 64 << 20
"""Largest staging buffer one batch takes from the device."""

_DIRECT_RUN = 8
"""Where an engine block is one run laid out as a host block (``Route.whole_blocks``), copy directly (no
staging) when runs hold at least this many blocks on average."""


@frozen(eq=False)
class _InFlight:
    job_id: JobId
    items: int
    done: torch.cuda.Event
    error: str | None


def _runs(first: IntArray, second: IntArray | None = None) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges where ``first`` (and ``second``, if given) go up by one."""
    steps = np.diff(first) == 1
    if second is not None:
        steps &= np.diff(second) == 1
    starts = [0, *(np.flatnonzero(~steps) + 1).tolist()]
    return list(zip(starts, [*starts[1:], len(first)], strict=True))


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """The same bytes as 8-byte elements when rows allow it: the index kernels copy 8x fewer items."""
    return rows.view(torch.int64) if rows.shape[-1] % 8 == 0 else rows


def stream_mark(device: torch.device) -> torch.cuda.Event:
    """An event after the work queued so far on the calling thread's current stream of ``device``."""
    ready = _event(blocking=False)
    ready.record(torch.cuda.current_stream(device))
    return ready


def _stream(device: torch.device) -> torch.cuda.Stream:
    # torch.cuda.Stream.__new__ carries no annotations.
    return torch.cuda.Stream(device, priority=_LOWEST_PRIORITY)  # type: ignore[no-untyped-call]


def _event(*, blocking: bool) -> torch.cuda.Event:
    # torch.cuda.Event.__new__ carries no annotations.
    return torch.cuda.Event(blocking=blocking)  # type: ignore[no-untyped-call]


class CudaLane:
    """Runs jobs on per-direction copy streams and reports them to ``board``."""

    def __init__(
        self, route_sets: Sequence[Sequence[Route]], host: HostMemory, board: JobBoard, device: torch.device
    ) -> None:
        self._route_sets = route_sets
        self._host = host.blocks
        self._board = board
        self._device = device
        self._block_bytes = host.block_bytes
        self._streams = {d: _stream(device) for d in Direction}
        self._pending: dict[Direction, queue.SimpleQueue[_InFlight | None]] = {
            d: queue.SimpleQueue() for d in Direction
        }
        self._loads: dict[JobId, torch.cuda.Event] = {}
        self._reapers = [
            threading.Thread(target=self._reap, args=(d,), name=f"kvcore-{d.value}-reaper", daemon=True)
            for d in Direction
        ]
        for reaper in self._reapers:
            reaper.start()

    def mark(self) -> torch.cuda.Event:
        return stream_mark(self._device)

    def start(
        self,
        job_id: JobId,
        direction: Direction,
        engine_ids: IntArray,
        host_ids: IntArray,
        after: object,
        which: int = 0,
    ) -> None:
        """Queue the job's copies, by route set ``which``, behind ``after`` (a ``stream_mark``; anything
        else fails the job, since nothing would order it after the engine's work); never raises."""
        if not isinstance(after, torch.cuda.Event):
            unordered = f"a CUDA copy is ordered after a CUDA event, not {after!r}"
            self._board.finish(JobResult(job_id, tuple(range(len(engine_ids))), unordered))
            return
        stream = self._streams[direction]
        error = None
        try:
            with torch.cuda.stream(stream):
                stream.wait_event(after)
                self._enqueue(direction, engine_ids, host_ids, self._route_sets[which])
        # Any failure to queue fails the job; what was queued still runs, so the job is reported only
        # once the stream has passed it.
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        try:
            done = _event(blocking=True)
            done.record(stream)
        except RuntimeError as exc:
            self._board.finish(JobResult(job_id, tuple(range(len(engine_ids))), f"{error or ''} {exc}"))
            return
        if direction is Direction.LOAD:
            self._loads[job_id] = done
        self._pending[direction].put(_InFlight(job_id, len(engine_ids), done, error))

    def wait_loaded(self, job_id: JobId, timeout: float) -> None:
        """Make the current stream wait for the load ``job_id``; the host does not block."""
        done = self._loads.get(job_id)
        if done is not None:
            torch.cuda.current_stream(self._device).wait_event(done)

    def close(self, timeout: float) -> None:
        """Let the reapers report every queued job, then join them (bounded)."""
        for pending in self._pending.values():
            pending.put(None)
        for reaper in self._reapers:
            reaper.join(timeout)

    def _reap(self, direction: Direction) -> None:
        pending = self._pending[direction]
        while True:
            job = pending.get()
            if job is None:
                return
            error = job.error
            try:
                job.done.synchronize()
            # A device fault surfaces here: it fails the job instead of killing the reaper.
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            failed = tuple(range(job.items)) if error else ()
            self._board.finish(JobResult(job.job_id, failed, error))
            self._loads.pop(job.job_id, None)

    def _enqueue(
        self, direction: Direction, engine_ids: IntArray, host_ids: IntArray, routes: Sequence[Route]
    ) -> None:
        count = len(engine_ids)
        if len(routes) == 1 and routes[0].whole_blocks:
            runs = _runs(engine_ids, host_ids)
            if len(runs) * _DIRECT_RUN <= count:
                self._copy_runs(direction, engine_ids, host_ids, runs, routes[0])
                return
        batch = max(1, _STAGING_BYTES // self._block_bytes)
        for a in range(0, count, batch):
            self._staged(direction, engine_ids[a : a + batch], host_ids[a : a + batch], routes)

    def _copy_runs(
        self,
        direction: Direction,
        engine_ids: IntArray,
        host_ids: IntArray,
        runs: list[tuple[int, int]],
        route: Route,
    ) -> None:
        engine, host = route.engine, route.host_view(self._host)
        first_row, width = int(route.engine_base[0]), len(route.engine_base)
        for a, b in runs:
            e, h, n = first_row + int(engine_ids[a]) * width, int(host_ids[a]) * width, (b - a) * width
            if direction is Direction.SAVE:
                host[h : h + n].copy_(engine[e : e + n], non_blocking=True)
            else:
                engine[e : e + n].copy_(host[h : h + n], non_blocking=True)

    def _staged(
        self, direction: Direction, engine_ids: IntArray, host_ids: IntArray, routes: Sequence[Route]
    ) -> None:
        count = len(engine_ids)
        staging = torch.empty((count, self._block_bytes), dtype=torch.uint8, device=self._device)
        if direction is Direction.LOAD:
            self._host_runs(direction, staging, host_ids)
        uploaded: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # routes of the same rows share
        for route in routes:
            rows_of = (route.engine_step, tuple(route.engine_base.tolist()))
            index = uploaded.get(rows_of)
            if index is None:
                index = uploaded[rows_of] = self._to_device(route.engine_rows(engine_ids))
            engine, rows = _wide(route.engine), _wide(route.host_view(staging))
            if direction is Direction.SAVE:
                torch.index_select(engine, 0, index, out=rows)
            else:
                engine.index_copy_(0, index, rows)
        if direction is Direction.SAVE:
            self._host_runs(direction, staging, host_ids)

    def _host_runs(self, direction: Direction, staging: torch.Tensor, host_ids: IntArray) -> None:
        """One host copy per run of consecutive host blocks, between ``staging`` and host memory."""
        for a, b in _runs(host_ids):
            h = int(host_ids[a])
            if direction is Direction.SAVE:
                self._host[h : h + b - a].copy_(staging[a:b], non_blocking=True)
            else:
                staging[a:b].copy_(self._host[h : h + b - a], non_blocking=True)

    def _to_device(self, rows: IntArray) -> torch.Tensor:
        # From page-locked memory, so the copy is asynchronous on the current (copy) stream; the host
        # allocator keeps the page-locked block until that copy has run.
        return torch.from_numpy(rows).pin_memory().to(self._device, non_blocking=True)
