"""``DiskChunkStore``: the ``ChunkStore`` port on a local directory, the worker side of the disk tier.

Every ``StoreItem`` names bytes of the rank's host pool; a put writes them as a chunk file, a get reads a
chunk file straight into them (``chunk_file``). Jobs run on a ``JobLane``, so ``submit_*`` return at once
and gets run before queued puts. Fault hooks, if given, run before each job (``kvcore.faults``).

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
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from attrs import frozen

from kvcore.errors import InvalidSpecError, UsageError
from kvcore.faults import FaultHooks, leading_failures
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.lane import JobLane, Priority
from kvcore.ports import Direction, StoreItem
from kvcore_disk.chunk_file import BadChunkFile, file_bytes, read_value, write_temporary
from kvcore_disk.directory import ChunkDirectory

__all__ = ["DiskChunkStore"]

log = logging.getLogger(__name__)


@frozen(eq=False)
class _Job:
    job_id: JobId
    put: bool
    items: tuple[StoreItem, ...]
    generation: int


class DiskChunkStore:
    """The ``ChunkStore`` port (and ``SupportsClear``) between ``host`` (the rank's host pool, which the
    caller keeps alive until ``close``) and the chunk files of ``directory``.

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
        self._threads = (
            ThreadPoolExecutor(io_threads, thread_name_prefix="kvcore-disk-io") if io_threads > 1 else None
        )
        self._directory = directory
        self._host = host.cast("B")
        self._fsync = fsync
        self._faults = faults
        self._board = JobBoard()
        self._state = threading.Lock()  # closed flag, generation
        self._io = threading.Lock()  # held by the lane around one job, and by clear
        self._closed = False
        self._generation = 0
        self._lane = JobLane("kvcore-disk-store")

    # -- the port ------------------------------------------------------------------------------------

    def exists(self, keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
        """Which keys have a chunk file (not read: a damaged one shows at its get)."""
        return tuple(self._directory.path(key).is_file() for key in keys)

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        """Write the items' host bytes as chunk files. A present key keeps its file. Raises
        ``InvalidSpecError`` (nothing queued) for bytes outside the host pool, ``UsageError`` once
        closed. A failed item (full disk, I/O error) leaves no file."""
        return self._submit(True, items)

    def submit_get(self, items: Sequence[StoreItem]) -> JobId:
        """Read the keys' chunk files into the items' host bytes. A missing key, a value of another
        length or a damaged file is a failed item (a miss): its host bytes are undefined."""
        return self._submit(False, items)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        """Remove keys' chunk files; missing ones are ignored."""
        self._directory.remove([self._directory.path(key) for key in keys])

    def clear(self) -> None:
        """Remove every chunk file (every process's) and fail the jobs queued before the call; a job
        already running finishes first."""
        with self._io:
            with self._state:
                self._generation += 1
            self._directory.clear()

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking jobs, fail those not started, join the lane (bounded by ``timeout``). Idempotent;
        every submitted job still gets a result. The files stay."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        self._lane.close(timeout, why="the disk store closed before the job ran")
        if self._threads is not None:
            self._threads.shutdown(wait=False)

    # -- the lane ------------------------------------------------------------------------------------

    def _submit(self, put: bool, items: Sequence[StoreItem]) -> JobId:
        for i, item in enumerate(items):
            if item.offset < 0 or item.length < 1 or item.offset + item.length > len(self._host):
                raise InvalidSpecError(
                    f"items[{i}] ({item.key!r}): bytes [{item.offset}, {item.offset + item.length}) are not "
                    f"a non-empty range of the {len(self._host)}-byte host pool"
                )
        with self._state:
            if self._closed:
                raise UsageError("the disk store is closed")
            job_id = self._board.new()
            job = _Job(job_id, put, tuple(items), self._generation)
            if items:  # under the lock that close takes first: the lane is still open
                priority = Priority.WRITE if put else Priority.READ
                self._lane.submit(partial(self._finish, job), partial(self._fail, job), priority)
        if not items:
            self._board.finish(JobResult(job_id))
        return job_id

    def _finish(self, job: _Job) -> None:
        self._board.finish(self._run(job))

    def _fail(self, job: _Job, why: str) -> None:
        self._board.finish(JobResult(job.job_id, tuple(range(len(job.items))), why))

    def _run(self, job: _Job) -> JobResult:
        with self._io:
            with self._state:
                cleared = job.generation != self._generation
            if cleared:
                return JobResult(job.job_id, tuple(range(len(job.items))), "the store was cleared")
            skip = leading_failures(
                self._faults, Direction.SAVE if job.put else Direction.LOAD, len(job.items)
            )
            items = job.items[skip:]
            done = self._map(self._put if job.put else self._get, items)
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
