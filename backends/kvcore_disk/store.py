"""``DiskChunkStore``: the ``ChunkStore`` port on a local directory, the worker side of the disk tier.

Every ``StoreItem`` names bytes of the rank's host pool; a put writes them as a chunk file, a get reads a
chunk file straight into them (``chunk_file``). Jobs run as every lane store runs them
(``kvcore.lane_store``: on a ``JobLane``, gets before queued puts, ``submit_*`` returning at once). Fault
hooks, if given, run before each job (``kvcore.faults``).

Semantics chosen, and why:

- **Re-put keeps the stored value.** Keys are content addresses: a present file is not written again.
- **A damaged file is a miss, and goes.** A file that is short, of another format, of another key or
  fails its digest is removed (with a warning) and its item fails: the engine recomputes those blocks.
  A whole value of another length is a miss too, and stays (it is another value's).
- **A full disk drops saves, never the engine.** ``ENOSPC`` and every other ``OSError`` of a write fail
  that item with a warning; nothing partial stays behind.
- **clear** removes every chunk file and dooms the jobs queued before it, so that no put in flight
  resurrects a cleared value.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvcore.errors import InvalidSpecError
from kvcore.faults import FaultHooks, leading_failures
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobResult
from kvcore.lane_store import LaneStore, StoreJob
from kvcore.ports import Direction, StoreItem
from kvcore_disk.chunk_file import BadChunkFile, file_bytes, read_value, write_temporary
from kvcore_disk.directory import ChunkDirectory

__all__ = ["DiskChunkStore"]

log = logging.getLogger(__name__)


class DiskChunkStore(LaneStore):
    """The ``ChunkStore`` port (and ``SupportsClear``) between ``host`` (the rank's host pool, which the
    caller keeps alive until ``close``) and the chunk files of ``directory``; jobs as every lane store
    runs them (``kvcore.lane_store``).

    ``fsync`` flushes each file to the device before it becomes visible (its folder after): chunks then
    survive a power loss too, at the cost of a device flush per chunk; without it they survive any
    process crash, and a power loss costs at most the chunks not yet written back, which their digest
    turns into misses. ``io_threads`` read and write a job's files side by side.
    """

    def __init__(
        self,
        directory: ChunkDirectory,
        host: memoryview,
        *,
        fsync: bool = False,
        io_threads: int = 4,
        faults: FaultHooks | None = None,
    ) -> None:
        if io_threads < 1:
            raise InvalidSpecError(f"io_threads: got {io_threads}, expected at least 1")
        self._host = host.cast("B")
        super().__init__("disk store", len(self._host))
        self._threads = (
            ThreadPoolExecutor(io_threads, thread_name_prefix="kvcore-disk-io") if io_threads > 1 else None
        )
        self._directory = directory
        self._fsync = fsync
        self._faults = faults

    # -- the port ------------------------------------------------------------------------------------

    def exists(self, keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
        """Which keys have a chunk file (not read: a damaged one shows at its get)."""
        return tuple(self._directory.path(key).is_file() for key in keys)

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        """Write the items' host bytes as chunk files. A present key keeps its file. Raises
        ``InvalidSpecError`` (nothing queued) for bytes outside the host pool, ``UsageError`` once
        closed. A failed item (full disk, I/O error) leaves no file."""
        return super().submit_put(items)

    def submit_get(self, items: Sequence[StoreItem]) -> JobId:
        """Read the keys' chunk files into the items' host bytes. A missing key, a value of another
        length or a damaged file is a failed item (a miss): its host bytes are undefined."""
        return super().submit_get(items)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """Remove keys' chunk files; missing ones are ignored."""
        self._directory.remove([self._directory.path(key) for key in keys])

    def clear(self) -> None:
        """Remove every chunk file (every process's) and fail the jobs queued before the call; a job
        already running finishes first."""
        with self._io:
            self._clear_queued()
            self._directory.clear()

    # -- the lane ------------------------------------------------------------------------------------

    def _closed_lane(self, timeout: float) -> None:
        """The files stay; the I/O threads end once their item is done."""
        if self._threads is not None:
            self._threads.shutdown(wait=False)

    def _run(self, job: StoreJob) -> JobResult:
        skip = leading_failures(self._faults, Direction.SAVE if job.put else Direction.LOAD, len(job.items))
        done = self._map(self._put if job.put else self._get, job.items[skip:])
        failed = tuple(range(skip)) + tuple(skip + i for i, ok in enumerate(done) if not ok)
        if not failed:
            return JobResult(job.job_id)
        why = f"{len(failed)} of {len(job.items)} {'writes' if job.put else 'reads'} failed"
        return JobResult(job.job_id, failed, why)

    def _map(self, move: Callable[[StoreItem], bool], items: Sequence[StoreItem]) -> list[bool]:
        """``move`` over ``items``, on the I/O threads when there are several items: reads and writes
        release the GIL, so a job's files overlap on the device and with each other's digests."""
        if len(items) < 2 or self._threads is None:
            return [_quietly(move, item) for item in items]
        # every item's future is waited for: a job is never reported while one of its reads still runs
        futures = [self._threads.submit(_quietly, move, item) for item in items]
        return [future.result() for future in futures]

    def _put(self, item: StoreItem) -> bool:
        """Write one chunk file (a key already present keeps its file); whether the chunk is stored."""
        path = self._directory.file(item.key)
        if os.path.isfile(path):
            return True
        value = self._host[item.offset : item.offset + item.length]
        try:
            temporary = write_temporary(path, item.key, value, fsync=self._fsync)
            self._directory.commit(temporary, path, file_bytes(item.key, item.length), fsync=self._fsync)
        except (OSError, ValueError) as exc:
            log.warning("kvcore disk tier: chunk %r not saved: %s", item.key, exc)
            return False
        return True

    def _get(self, item: StoreItem) -> bool:
        path = self._directory.file(item.key)
        try:
            return read_value(path, item.key, self._host[item.offset : item.offset + item.length])
        except BadChunkFile as exc:
            log.warning("kvcore disk tier: %s is not a whole chunk (%s): removed, a miss", path, exc)
            try:
                self._directory.remove([path])
            except OSError as gone:
                log.warning("kvcore disk tier: cannot remove %s: %s", path, gone)
        except OSError as exc:
            log.warning("kvcore disk tier: cannot read %s: %s (a miss)", path, exc)
        return False


def _quietly(move: Callable[[StoreItem], bool], item: StoreItem) -> bool:
    """``move(item)``; an exception it did not expect fails the item (logged), never the job's others."""
    try:
        return move(item)
    except Exception as exc:  # a bug or an odd OS error: this item failed, the job goes on
        log.warning("kvcore disk tier: %r failed: %s: %s", item.key, type(exc).__name__, exc, exc_info=True)
        return False
