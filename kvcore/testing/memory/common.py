"""Shared by the in-memory references: the job lane and gate, value storage, item checks, ``POISON``."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from functools import partial
from typing import ClassVar

from kvcore.errors import (
    BackendUnavailable,
    ConfigError,
    KVCoreError,
    UsageError,
)
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.kit.host_ranges import check_ranges
from kvcore.kit.lane import JobLane, LaneClosed
from kvcore.ports import StoreItem
from kvcore.testing.faults import InjectedFaults

__all__ = [
    "POISON",
    "Gate",
    "Jobs",
    "Outages",
    "ValueJobs",
    "Values",
    "Work",
    "check_answering",
    "check_items",
    "check_positive",
    "copy_out",
]


POISON = 0xA5
"""The byte written over the destination of a failed item."""

Work = Callable[[JobId], JobResult]


def check_positive(name: str, value: int | None, expected: str = "an integer >= 1") -> None:
    if value is not None and value < 1:
        raise ConfigError(name, value, expected)


class Gate:
    """Stalls and injected failures, shared by every reference backend.

    One re-entrant condition guards the backend's own state: a reference backend does one thing at a
    time, which is what makes it obviously right.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._faults = InjectedFaults()

    def fail_next(self, count: int) -> None:
        """The next ``count`` items processed fail (see ``SupportsFailureInjection``)."""
        self._faults.fail_next(count)

    def stall(self) -> AbstractContextManager[None]:
        """While inside, queued jobs and pending lookups do not finish."""
        return self._faults.stall()

    def _take_failure(self) -> bool:
        return self._faults.take(1) == 1


class Jobs(Gate):
    """Jobs in submission order on a ``JobLane``, with results handed out by a ``JobBoard``.

    ``close`` refuses later submits with ``refused_after_close`` (the port's error); jobs queued before
    it still run.
    """

    refused_after_close: ClassVar[type[KVCoreError]] = UsageError

    def __init__(self) -> None:
        super().__init__()
        self._board = JobBoard()
        self._lane = JobLane(f"{type(self).__name__}-jobs")
        self._closed = False

    def close(self) -> None:
        with self._cond:
            self._closed = True

    def _check_open(self, call: str) -> None:
        with self._cond:
            if self._closed:
                raise self.refused_after_close(f"{call}: this {type(self).__name__} is closed")

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def pending_jobs(self) -> int:
        """Jobs taken and not yet reported (``SupportsPendingJobs``)."""
        return self._board.in_flight()

    def _submit(self, work: Work) -> JobId:
        with self._cond:
            self._check_open("submit")
            job_id = self._board.new()
            try:
                self._lane.submit(partial(self._run, job_id, work), partial(self._fail, job_id))
            except LaneClosed:
                self._board.forget(job_id)  # refused: no id stays pending
                raise
            return job_id

    def _run(self, job_id: JobId, work: Work) -> None:
        self._faults.wait_released()
        self._board.finish(work(job_id))

    def _fail(self, job_id: JobId, why: str) -> None:
        """A job whose work raised: a bug in the reference, which the lane logs; the job still ends."""
        self._board.finish(JobResult(job_id, error=why))


class Outages:
    """A reference that stands for a client of a server, which ``outage`` takes away (``SupportsOutage``).
    Mixed into a ``Gate``: ``_check_reachable`` and ``_down`` are read with ``_cond`` held."""

    _cond: threading.Condition
    _down = 0

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """While inside, what asks the server raises ``BackendUnavailable`` and jobs fail every item;
        what the server holds stays."""
        with self._cond:
            self._down += 1
        try:
            yield
        finally:
            with self._cond:
                self._down -= 1

    def _check_reachable(self) -> None:
        if self._down:
            raise BackendUnavailable(f"the server of this {type(self).__name__} is unreachable")


def check_items(items: Sequence[StoreItem], host_size: int) -> None:
    for i, item in enumerate(items):
        check_ranges(i, item, host_size)


class Values:
    """Values by key, least recently used first, under an optional bound in bytes.

    ``reserved`` counts bytes promised to puts in flight: they take room but cannot be evicted.
    """

    def __init__(self, capacity: int | None) -> None:
        check_positive("capacity", capacity, "a number of bytes >= 1, or None for no bound")
        self.capacity = capacity
        self.data: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self.reserved: dict[ChunkKey, int] = {}

    def used(self) -> int:
        return sum(map(len, self.data.values())) + sum(self.reserved.values())

    def make_room(self, length: int, protected: Callable[[ChunkKey], bool]) -> bool:
        """Evict unprotected values, oldest first, until ``length`` more bytes fit; False (evicting
        nothing) when they cannot."""
        if self.capacity is None:
            return True
        victims = [k for k in self.data if not protected(k)]
        evictable = sum(len(self.data[k]) for k in victims)
        if self.used() - evictable + length > self.capacity:
            return False
        for key in victims:
            if self.used() + length <= self.capacity:
                break
            del self.data[key]
        return True


# -- scheduler side ------------------------------------------------------------------------------------


def check_answering(closed: bool, owner: object) -> None:
    """A closed index or tier answers no lookup (``ChunkIndex.close``)."""
    if closed:
        raise BackendUnavailable(f"this {type(owner).__name__} is closed: it answers no lookup")


# -- worker side ---------------------------------------------------------------------------------------


def copy_out(
    host: bytearray,
    items: Sequence[StoreItem],
    value_of: Callable[[ChunkKey], bytes | None],
    take_failure: Callable[[], bool],
) -> tuple[int, ...]:
    """Copy each item's value into its host bytes; poison and list the misses and failures."""
    failed: list[int] = []
    for i, item in enumerate(items):
        value = value_of(item.key)
        if take_failure() or value is None or len(value) != item.length:
            failed.append(i)
            value = bytes([POISON]) * item.length
        done = 0
        for offset, length in item.ranges():
            host[offset : offset + length] = value[done : done + length]
            done += length
    return tuple(failed)


def gather(host: bytearray, item: StoreItem) -> bytes:
    """The item's value: its host ranges, one after another."""
    return b"".join(host[offset : offset + length] for offset, length in item.ranges())


class ValueJobs(Jobs):
    """``Jobs`` of a reference that holds values over a host buffer (a store, a managed tier), with the
    out-of-band access the conformance harnesses use (``peek``, ``poke``)."""

    def __init__(self, host: bytearray, capacity: int | None) -> None:
        super().__init__()
        self._host = host
        self._values = Values(capacity)

    # Out-of-band access, for tests.

    def peek(self, key: ChunkKey) -> bytes | None:
        with self._cond:
            return self._values.data.get(key)

    def poke(self, key: ChunkKey, value: bytes) -> None:
        """Set a value directly (the most recent; no capacity check)."""
        with self._cond:
            self._values.data[key] = bytes(value)
            self._values.data.move_to_end(key)
