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

import enum
import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import torch

from kvcore.ports import Direction
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.rows import IntArray, Route

__all__ = ["BlockCopier", "ByteRows", "RowTask", "copy_rows"]

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


class _Form(enum.Enum):
    """How a task's rows are copied; the order is the preference among equal costs."""

    SLICE = "slice"  # runs on both sides
    GATHER = "gather"  # runs of destination rows
    SCATTER = "scatter"  # runs of source rows
    STAGED = "staged"  # no runs: through the staging buffer


class RowTask:
    """Copy ``src[src_rows[i]]`` to ``dst[dst_rows[i]]`` for every ``i``.

    Planned once: a form and the ranges of pairs (``starts[k]:stops[k]``) that each take one numpy call.
    Threads then copy groups of ranges (``copy(lo, hi)``) independently.
    """

    __slots__ = ("dst", "dst_rows", "form", "src", "src_rows", "starts", "stops")

    def __init__(
        self, src: ByteRows, dst: ByteRows, src_rows: IntArray, dst_rows: IntArray, batch: int
    ) -> None:
        self.src = src
        self.dst = dst
        self.src_rows = src_rows
        self.dst_rows = dst_rows
        self.form, self.starts, self.stops = _plan(src, dst, src_rows, dst_rows, batch)

    def pieces(self, rows: int) -> list[tuple[int, int]]:
        """Cut ranges longer than ``rows`` pairs, then group them: ``(lo, hi)`` of about ``rows`` pairs."""
        lengths = self.stops - self.starts
        parts = (lengths + rows - 1) // rows
        if len(parts) and int(parts.max()) > 1:
            first = np.repeat(self.starts, parts)
            step = np.arange(len(first), dtype=np.int64) - np.repeat(np.cumsum(parts) - parts, parts)
            self.starts = first + step * rows
            self.stops = np.minimum(self.starts + rows, np.repeat(self.stops, parts))
            lengths = self.stops - self.starts
        group = (np.cumsum(lengths) - 1) // rows
        edges = [0, *(np.flatnonzero(group[1:] != group[:-1]) + 1).tolist(), len(lengths)]
        return list(itertools.pairwise(edges))

    def copy(self, lo: int, hi: int, staging: ByteRows) -> None:
        """Copy ranges ``lo`` to ``hi``; ``staging`` is scratch of at least one row."""
        src, dst, s, d = self.src, self.dst, self.src_rows, self.dst_rows
        starts, stops = self.starts[lo:hi], self.stops[lo:hi]
        if self.form is _Form.STAGED:
            for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
                for c in range(a, b, len(staging)):
                    e = min(b, c + len(staging))
                    buffer = staging[: e - c]
                    if src.flags.c_contiguous:
                        np.take(src, s[c:e], axis=0, out=buffer, mode="clip")
                    else:
                        buffer[...] = src[s[c:e]]
                    dst[d[c:e]] = buffer
            return
        ranges = zip(starts.tolist(), stops.tolist(), s[starts].tolist(), d[starts].tolist(), strict=True)
        if self.form is _Form.SLICE:
            for a, b, sa, da in ranges:
                np.copyto(dst[da : da + b - a], src[sa : sa + b - a])
        elif self.form is _Form.GATHER:
            for a, b, _, da in ranges:
                np.take(src, s[a:b], axis=0, out=dst[da : da + b - a], mode="clip")
        else:
            for a, b, sa, _ in ranges:
                dst[d[a:b]] = src[sa : sa + b - a]


def _plan(
    src: ByteRows, dst: ByteRows, s: IntArray, d: IntArray, batch: int
) -> tuple[_Form, IntArray, IntArray]:
    """The form that needs the least time in Python calls, and its ranges of pairs."""
    count = len(s)
    next_s = (s[1:] - s[:-1]) == 1
    next_d = (d[1:] - d[:-1]) == 1
    steps = {_Form.SLICE: next_s & next_d, _Form.GATHER: next_d, _Form.SCATTER: next_s}
    if not (src.flags.c_contiguous and dst.flags.c_contiguous):
        del steps[_Form.GATHER]  # np.take copies a non-contiguous array whole
    costs: dict[_Form, float] = {
        form: (count - int(np.count_nonzero(run))) * _CALL_BYTES for form, run in steps.items()
    }
    costs[_Form.STAGED] = -(-count // batch) * 2 * _CALL_BYTES + count * src.shape[1] * _STAGING_COST
    form = min(costs, key=costs.__getitem__)
    if form is _Form.STAGED:
        starts = np.arange(0, count, batch, dtype=np.int64)
        return form, starts, np.minimum(starts + batch, count)
    breaks: IntArray = np.concatenate((np.zeros(1, np.int64), np.flatnonzero(~steps[form]) + 1))
    return form, breaks, np.append(breaks[1:], count)


def copy_rows(src: ByteRows, dst: ByteRows, s: IntArray, d: IntArray, staging: ByteRows) -> None:
    """Copy rows ``src[s[i]] -> dst[d[i]]`` on the calling thread; ``staging`` holds at least one row."""
    if len(s):
        task = RowTask(src, dst, s, d, len(staging))
        task.copy(0, len(task.starts), staging)


class BlockCopier:
    """Executes block copies for one engine and one host memory on the calling thread plus helpers."""

    def __init__(self, routes: Sequence[Route], host: HostMemory, threads: int) -> None:
        self._routes = [
            (route, _numpy(route.engine), _numpy(route.host_view(host.blocks))) for route in routes
        ]
        self._row_bytes = int(routes[0].engine.shape[1])
        self._threads = threads
        self._batch = max(1, _STAGING_BYTES // self._row_bytes)
        self._staging = [np.empty((self._batch, self._row_bytes), dtype=np.uint8) for _ in range(threads)]
        self._helpers = (
            ThreadPoolExecutor(threads - 1, thread_name_prefix="kvcore-copy") if threads > 1 else None
        )

    def copy(self, direction: Direction, engine_ids: IntArray, host_ids: IntArray) -> None:
        """Copy every plane of the given block pairs; returns when all bytes are in place."""
        tasks = []
        for route, engine, host in self._routes:
            engine_rows, host_rows = route.engine_rows(engine_ids), route.host_rows(host_ids)
            if direction is Direction.SAVE:
                tasks.append(RowTask(engine, host, engine_rows, host_rows, self._batch))
            else:
                tasks.append(RowTask(host, engine, host_rows, engine_rows, self._batch))
        total = sum(len(t.src_rows) for t in tasks)
        helpers = self._helpers if total * self._row_bytes >= _SPLIT_BYTES else None
        piece_bytes = min(_PIECE_BYTES, total * self._row_bytes // (4 * self._threads))
        rows = total if helpers is None else max(1, piece_bytes // self._row_bytes)
        pieces = iter([(task, lo, hi) for task in tasks for lo, hi in task.pieces(rows)])
        lock = threading.Lock()

        def drain(thread: int) -> None:
            while True:
                with lock:
                    piece = next(pieces, None)
                if piece is None:
                    return
                task, lo, hi = piece
                task.copy(lo, hi, self._staging[thread])

        futures = [helpers.submit(drain, t) for t in range(1, self._threads)] if helpers is not None else []
        try:
            drain(0)
        finally:
            for future in futures:
                future.exception()
        for future in futures:
            future.result()

    def close(self) -> None:
        """Let the helper threads exit once idle; does not wait for a copy in progress."""
        if self._helpers is not None:
            self._helpers.shutdown(wait=False)


def _numpy(rows: torch.Tensor) -> ByteRows:
    array: ByteRows = rows.numpy()
    return array
