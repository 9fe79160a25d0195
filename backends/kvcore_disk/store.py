"""``DiskChunkStore``: the ``ChunkStore`` port on a local directory, the worker side of the disk tier.

Every ``StoreItem`` names bytes of the rank's host pool; a put writes them as a chunk file, a get reads a
chunk file straight into them (``chunk_file``). Jobs run as every lane store runs them
(``kvcore.kit.lane_store``, ``submit_*`` returning at once), gets on a lane and I/O threads of their own:
a put may wait for the directory's lock, which another process may hold, and a get must never wait
behind it. Fault hooks, if given, run before each job (``kvcore.kit.faults``).

Semantics chosen, and why:

- **Re-put keeps the stored value.** Keys are content addresses: a present file is not written again.
- **A damaged file is a miss, and goes.** A file that is short, of another format, of another key or
  fails its digest is removed (with a warning) and its item fails: the engine recomputes those blocks.
  A whole value of another length is a miss too, and stays (it is another value's).
- **A full disk drops saves, never the engine.** ``ENOSPC`` and every other ``OSError`` of a write fail
  that item, with a warning repeated at most once a minute (with a count); nothing partial stays
  behind.
- **A lock held elsewhere drops saves, never stalls loads.** A put job waits at most ``LOCK_WAIT_S`` for
  the directory's lock (another process holds it to commit, evict, or is frozen holding it); its items
  not committed by then fail. Gets never take the lock: a damaged file found by a get is removed
  behind the puts.
- **clear** removes every chunk file and dooms the jobs queued before it, so that no put in flight
  resurrects a cleared value.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from kvcore.errors import BackendUnavailable, InvalidSpecError
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobResult
from kvcore.kit.faults import FaultHooks, leading_failures
from kvcore.kit.host_ranges import views
from kvcore.kit.lane_store import LaneStore, StoreJob
from kvcore.kit.repeats import RepeatedWarnings
from kvcore.ports import Direction, StoreItem
from kvcore_disk.chunk_file import BadChunkFile, file_bytes, read_value, write_temporary
from kvcore_disk.directory import LOCK_WAIT_S, ChunkDirectory, LockBusy

__all__ = ["DiskChunkStore"]

log = logging.getLogger(__name__)


class DiskChunkStore(LaneStore):
    """The ``ChunkStore`` port (and ``SupportsClear``) between ``host`` (the rank's host pool, which the
    caller keeps alive until ``close``) and the chunk files of ``directory``; jobs as every lane store
    runs them (``kvcore.kit.lane_store``).

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
        super().__init__("disk store", len(self._host), separate_reads=True)
        self._threads = {  # by job kind (put): a read never queues behind a write waiting for the lock
            put: ThreadPoolExecutor(
                io_threads, thread_name_prefix=f"kvcore-disk-{'write' if put else 'read'}"
            )
            for put in (True, False)
            if io_threads > 1
        }
        self._directory = directory
        self._fsync = fsync
        self._faults = faults
        self._warnings = RepeatedWarnings(log)

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
        """Remove keys' chunk files; missing ones are ignored. Raises ``BackendUnavailable`` (nothing
        removed) when the directory's lock stays held elsewhere."""
        try:
            self._directory.remove([self._directory.path(key) for key in keys])
        except LockBusy as exc:
            raise BackendUnavailable(f"disk tier: {exc}") from None

    def clear(self) -> None:
        """Remove every chunk file (every process's) and fail the jobs queued before the call; a job
        already running finishes first. Raises ``BackendUnavailable`` when the directory's lock stays
        held elsewhere (the queued jobs still fail)."""
        with self._io:
            self._clear_queued()
            try:
                self._directory.clear()
            except LockBusy as exc:
                raise BackendUnavailable(f"disk tier: {exc}") from None

    # -- the lane ------------------------------------------------------------------------------------

    def _closed_lane(self, timeout: float) -> None:
        """The files stay; the I/O threads end once their item is done."""
        for threads in self._threads.values():
            threads.shutdown(wait=False)

    def _run(self, job: StoreJob) -> JobResult:
        skip = leading_failures(self._faults, Direction.SAVE if job.put else Direction.LOAD, len(job.items))
        if job.put:
            deadline = time.monotonic() + LOCK_WAIT_S  # the job's whole wait for the lock
            done = self._map(job.put, partial(self._put, deadline=deadline), job.items[skip:])
        else:
            done = self._map(job.put, self._get, job.items[skip:])
        failed = tuple(range(skip)) + tuple(skip + i for i, ok in enumerate(done) if not ok)
        if not failed:
            return JobResult(job.job_id)
        why = f"{len(failed)} of {len(job.items)} {'writes' if job.put else 'reads'} failed"
        return JobResult(job.job_id, failed, why)

    def _map(self, put: bool, move: Callable[[StoreItem], bool], items: Sequence[StoreItem]) -> list[bool]:
        """``move`` over ``items``, on the I/O threads of their kind when there are several items: reads
        and writes release the GIL, so a job's files overlap on the device and with each other's
        digests."""
        threads = self._threads.get(put)
        if len(items) < 2 or threads is None:
            return [_quietly(move, item) for item in items]
        # every item's future is waited for: a job is never reported while one of its reads still runs
        futures = [threads.submit(_quietly, move, item) for item in items]
        return [future.result() for future in futures]

    def _put(self, item: StoreItem, deadline: float) -> bool:
        """Write one chunk file (a key already present keeps its file), waiting for the directory's lock
        until ``deadline``; whether the chunk is stored."""
        path = self._directory.file(item.key)
        if os.path.isfile(path):
            return True
        value = views(self._host, item)
        try:
            wait = deadline - time.monotonic()
            if wait <= 0:  # an item before it found the lock held the whole wait: no file is written
                raise LockBusy(self._directory.lock_path)
            temporary = write_temporary(path, item.key, value, fsync=self._fsync)
            nbytes = file_bytes(item.key, item.length)
            self._directory.commit(temporary, path, nbytes, fsync=self._fsync, wait=wait)
        except (OSError, ValueError) as exc:
            log.debug("kvcore disk tier: chunk %r not saved: %s", item.key, exc)
            self._warnings.warn(f"disk tier: chunks not saved: {_cause(exc)}")
            return False
        return True

    def _get(self, item: StoreItem) -> bool:
        path = self._directory.file(item.key)
        try:
            return read_value(path, item.key, views(self._host, item))
        except BadChunkFile as exc:
            log.warning("kvcore disk tier: %s is not a whole chunk (%s): removed, a miss", path, exc)
            self._background(partial(self._directory.remove, [path]), f"removing damaged chunk file {path}")
        except OSError as exc:
            log.warning("kvcore disk tier: cannot read %s: %s (a miss)", path, exc)
        return False


def _cause(exc: Exception) -> str:
    """What went wrong, without the file or key it went wrong with: one text for every chunk that fails
    alike (a full disk), so that the warning repeats as one."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"


def _quietly(move: Callable[[StoreItem], bool], item: StoreItem) -> bool:
    """``move(item)``; an exception it did not expect fails the item (logged), never the job's others."""
    try:
        return move(item)
    except Exception as exc:  # a bug or an odd OS error: this item failed, the job goes on
        log.warning("kvcore disk tier: %r failed: %s: %s", item.key, type(exc).__name__, exc, exc_info=True)
        return False
