"""The in-memory reference ``ChunkStore`` (and ``SupportsClear``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import partial

from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobResult
from kvcore.ports import StoreItem
from kvcore.testing.memory.common import Outages, ValueJobs, check_items, copy_out, gather

__all__ = ["InMemoryChunkStore"]


class InMemoryChunkStore(Outages, ValueJobs):
    """A dict of values over one registered host ``bytearray``, optionally bounded in bytes.

    A put reserves room when submitted, evicting the least recently used values that no get in flight
    reads (leased); an item that finds no room fails. ``clear`` fails the puts in flight, so none
    resurrects a value after it. During an ``outage`` (it stands for a store's client), ``exists`` and
    ``remove`` raise ``BackendUnavailable`` and the jobs that run fail every item.
    """

    def __init__(self, host: bytearray, capacity: int | None = None) -> None:
        super().__init__(host, capacity)
        self._leases: Counter[ChunkKey] = Counter()
        self._generation = 0

    @property
    def capacity(self) -> int | None:
        return self._values.capacity

    def __len__(self) -> int:
        """Values held."""
        with self._cond:
            return len(self._values.data)

    def exists(self, keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
        with self._cond:
            self._check_reachable()
            return tuple(k in self._values.data for k in keys)

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        check_items(items, len(self._host))
        items = tuple(items)
        with self._cond:
            reserved: list[int] = []
            for i, item in enumerate(items):
                if item.key in self._values.data or item.key in self._values.reserved:
                    continue
                if self._values.make_room(item.length, lambda k: self._leases[k] > 0):
                    self._values.reserved[item.key] = item.length
                    reserved.append(i)
            work = partial(self._put, items, frozenset(reserved), self._generation)
            return self._submit(work)

    def _put(
        self, items: tuple[StoreItem, ...], reserved: frozenset[int], generation: int, job_id: JobId
    ) -> JobResult:
        failed: list[int] = []
        with self._cond:
            for i, item in enumerate(items):
                if i in reserved:
                    del self._values.reserved[item.key]
                injected = self._take_failure() or bool(self._down)
                present = item.key in self._values.data
                if injected or (i not in reserved and not present) or generation != self._generation:
                    failed.append(i)
                elif not present:
                    self._values.data[item.key] = gather(self._host, item)
        return JobResult(job_id, tuple(failed))

    def submit_get(self, items: Sequence[StoreItem]) -> JobId:
        check_items(items, len(self._host))
        items = tuple(items)
        with self._cond:
            leased = [item.key for item in items if item.key in self._values.data]
            self._leases.update(leased)
            for key in leased:
                self._values.data.move_to_end(key)
            return self._submit(partial(self._get, items, tuple(leased)))

    def _get(self, items: tuple[StoreItem, ...], leased: tuple[ChunkKey, ...], job_id: JobId) -> JobResult:
        with self._cond:
            down = bool(self._down)
            failed = copy_out(self._host, items, self._values.data.get, lambda: self._take_failure() or down)
            self._leases.subtract(leased)
            self._leases = +self._leases
        return JobResult(job_id, failed)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        with self._cond:
            self._check_reachable()
            for key in keys:
                self._values.data.pop(key, None)

    def clear(self) -> None:
        with self._cond:
            self._values.data.clear()
            self._generation += 1
