"""Block copies between a CPU engine's KV memory and host memory, at memory-copy speed.

A job becomes, per route, two arrays of row indices (source rows, destination rows). Each is copied with
whichever of four numpy forms needs the fewest Python-level calls, since a call costs about as much as
copying a 16 KiB row:

- runs of consecutive rows on both sides: one slice copy per run (adjacent blocks coalesced);
- consecutive destination rows: one ``np.take(..., out=)`` gather per run;
- consecutive source rows: one fancy-index scatter per run;
- neither: gather a batch into a small cache-resident staging buffer, then scatter it.

numpy releases the GIL inside all four, so a large job is shared by ``threads`` threads (the caller's and
``threads - 1`` helpers), which take pieces of it in turn.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import torch

from kvcore.ports import Direction
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.rows import IntArray, Route

__all__ = ["BlockCopier", "RowTask", "copy_rows"]

ByteRows = npt.NDArray[np.uint8]

_CALL_BYTES = 16 << 10
"""A Python-level numpy call costs about as long as copying this many bytes (measured: ~1.5 us)."""

_STAGING_BYTES = 256 << 10
"""Staging batch for pairs with no runs: fits in L2, so the second pass costs little."""

_STAGING_COST = 0.35
"""Extra time of copying through the staging buffer, relative to the bytes copied."""

_SPLIT_BYTES = 2 << 20
"""Jobs below this stay on one thread: handing work to a helper costs more than it saves."""

_PIECE_BYTES = 4 << 20
"""Threads take work in pieces of at most this size (and at least four per thread), so that a thread
that starts late (its core busy with the engine) takes fewer pieces instead of holding up a fixed half."""


class RowTask:
    """Copy ``src[src_rows[i]]`` to ``dst[dst_rows[i]]`` for every ``i``."""

    __slots__ = ("dst", "dst_rows", "src", "src_rows")

    def __init__(self, src: ByteRows, dst: ByteRows, src_rows: IntArray, dst_rows: IntArray) -> None:
        self.src = src
        self.dst = dst
        self.src_rows = src_rows
        self.dst_rows = dst_rows


def _run_bounds(steps: npt.NDArray[np.bool_]) -> zip[tuple[int, int]]:
    """``(start, stop)`` of the runs in which every step continues the run."""
    starts = [0, *(np.flatnonzero(~steps) + 1).tolist()]
    return zip(starts, [*starts[1:], len(steps) + 1], strict=True)


def copy_rows(src: ByteRows, dst: ByteRows, s: IntArray, d: IntArray, staging: ByteRows) -> None:
    """Copy rows ``src[s[i]] -> dst[d[i]]``; ``staging`` is scratch of at least one row."""
    count = len(s)
    if count == 0:
        return
    next_s = np.diff(s) == 1
    next_d = np.diff(d) == 1
    both = next_s & next_d
    batch = len(staging)
    gather_ok = src.flags.c_contiguous and dst.flags.c_contiguous
    costs = (
        (count - int(np.count_nonzero(both))) * _CALL_BYTES,
        (count - int(np.count_nonzero(next_d))) * _CALL_BYTES if gather_ok else float("inf"),
        (count - int(np.count_nonzero(next_s))) * _CALL_BYTES,
        -(-count // batch) * 2 * _CALL_BYTES + count * src.shape[1] * _STAGING_COST,
    )
    best = costs.index(min(costs))
    if best == 0:
        for a, b in _run_bounds(both):
            sa, da = int(s[a]), int(d[a])
            np.copyto(dst[da : da + b - a], src[sa : sa + b - a])
    elif best == 1:
        for a, b in _run_bounds(next_d):
            da = int(d[a])
            np.take(src, s[a:b], axis=0, out=dst[da : da + b - a], mode="clip")
    elif best == 2:
        for a, b in _run_bounds(next_s):
            sa = int(s[a])
            dst[d[a:b]] = src[sa : sa + b - a]
    else:
        for a in range(0, count, batch):
            b = min(count, a + batch)
            buffer = staging[: b - a]
            if src.flags.c_contiguous:
                np.take(src, s[a:b], axis=0, out=buffer, mode="clip")
            else:
                buffer[...] = src[s[a:b]]
            dst[d[a:b]] = buffer


class BlockCopier:
    """Executes block copies for one engine and one host memory on the calling thread plus helpers."""

    def __init__(self, routes: Sequence[Route], host: HostMemory, threads: int) -> None:
        self._routes = [
            (route, _numpy(route.engine), _numpy(route.host_view(host.blocks))) for route in routes
        ]
        self._row_bytes = int(routes[0].engine.shape[1])
        self._threads = threads
        rows = max(1, _STAGING_BYTES // self._row_bytes)
        self._staging = [np.empty((rows, self._row_bytes), dtype=np.uint8) for _ in range(threads)]
        self._helpers = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="kvcore-copy") if threads > 1 else None
        )

    def copy(self, direction: Direction, engine_ids: IntArray, host_ids: IntArray) -> None:
        """Copy every plane of the given block pairs; returns when all bytes are in place."""
        tasks = []
        for route, engine, host in self._routes:
            engine_rows, host_rows = route.engine_rows(engine_ids), route.host_rows(host_ids)
            if direction is Direction.SAVE:
                tasks.append(RowTask(engine, host, engine_rows, host_rows))
            else:
                tasks.append(RowTask(host, engine, host_rows, engine_rows))
        total = sum(len(t.src_rows) for t in tasks) * self._row_bytes
        helpers = self._helpers if total >= _SPLIT_BYTES else None
        piece_bytes = total if helpers is None else min(_PIECE_BYTES, total // (4 * self._threads))
        pieces = iter(self._pieces(tasks, piece_bytes))
        lock = threading.Lock()

        def drain(thread: int) -> None:
            while True:
                with lock:
                    piece = next(pieces, None)
                if piece is None:
                    return
                task, a, b = piece
                copy_rows(task.src, task.dst, task.src_rows[a:b], task.dst_rows[a:b], self._staging[thread])

        futures = [helpers.submit(drain, t) for t in range(1, self._threads)] if helpers is not None else []
        try:
            drain(0)
        finally:
            for future in futures:
                future.exception()
        for future in futures:
            future.result()

    def _pieces(self, tasks: Sequence[RowTask], piece_bytes: int) -> list[tuple[RowTask, int, int]]:
        """Each task cut into pieces of about ``piece_bytes``, for the threads to take in turn."""
        rows = max(1, piece_bytes // self._row_bytes)
        return [
            (t, a, min(a + rows, len(t.src_rows))) for t in tasks for a in range(0, len(t.src_rows), rows)
        ]

    def close(self) -> None:
        """Let the helper threads exit once idle; does not wait for a copy in progress."""
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)


def _numpy(rows: torch.Tensor) -> ByteRows:
    array: ByteRows = rows.numpy()
    return array
