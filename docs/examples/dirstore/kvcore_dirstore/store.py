"""The worker side: a ``ChunkStore`` that moves chunk values between the rank's host pool and files."""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from pathlib import Path

from kvcore.errors import InvalidSpecError, UsageError
from kvcore.ids import ChunkKey, JobId
from kvcore.jobs import JobBoard, JobResult
from kvcore.ports import StoreItem
from kvcore_dirstore.files import chunk_path, write_atomically

__all__ = ["DirChunkStore"]

log = logging.getLogger(__name__)


class DirChunkStore:
    """Chunk values as files under ``root``, copied to and from ``host`` (the rank's host pool).

    Jobs run inline, in ``submit_*``: the files are local and small (one chunk each), and the worker
    calls a store off the engine's critical path only for saves. A store whose I/O can be slow (a network
    filesystem) would run them on a thread and finish them through the same ``JobBoard``. It holds
    nothing but the host pool, which ``close`` hands back: later submits raise ``UsageError``.
    """

    def __init__(self, root: Path, host: memoryview) -> None:
        self._root = root
        self._host = host.cast("B")
        self._board = JobBoard()
        self._closed = False
        root.mkdir(parents=True, exist_ok=True)

    def exists(self, keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
        return tuple(chunk_path(self._root, key).is_file() for key in keys)

    def submit_put(self, items: Sequence[StoreItem]) -> JobId:
        self._check(items)
        job = self._board.new()
        failed = tuple(i for i, item in enumerate(items) if not self._put(item))
        self._board.finish(JobResult(job, failed))
        return job

    def submit_get(self, items: Sequence[StoreItem]) -> JobId:
        self._check(items)
        job = self._board.new()
        failed = tuple(i for i, item in enumerate(items) if not self._get(item))
        self._board.finish(JobResult(job, failed))
        return job

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            chunk_path(self._root, key).unlink(missing_ok=True)

    def clear(self) -> None:
        """Drop every chunk (``SupportsClear``)."""
        for path in self._root.iterdir():
            path.unlink(missing_ok=True)

    def poll(self) -> tuple[JobResult, ...]:
        return self._board.poll()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._board.wait(job_ids, timeout)

    def close(self) -> None:
        self._closed = True

    def _check(self, items: Sequence[StoreItem]) -> None:
        """Refuse items outside the host pool before any byte moves (the port's bad-input contract), and
        every item once closed."""
        if self._closed:
            raise UsageError("the dirstore is closed")
        for i, item in enumerate(items):
            if not (item.offset >= 0 and item.length > 0 and item.offset + item.length <= len(self._host)):
                raise InvalidSpecError(
                    f"items[{i}]: bytes [{item.offset}, {item.offset + item.length}) are not inside the "
                    f"host pool of {len(self._host)} bytes"
                )

    def _put(self, item: StoreItem) -> bool:
        path = chunk_path(self._root, item.key)
        if path.is_file():  # content-addressed: a present key keeps its first value
            return True
        try:
            write_atomically(path, self._host[item.offset : item.offset + item.length])
        except OSError as exc:  # a full or read-only disk: the chunk is not stored, a failed item
            log.warning("dirstore: cannot write %s: %s", path, exc)
            return False
        return True

    def _get(self, item: StoreItem) -> bool:
        try:
            with chunk_path(self._root, item.key).open("rb") as file:
                if file.seek(0, 2) != item.length:  # another length is another value: a miss
                    return False
                file.seek(0)
                return file.readinto(self._host[item.offset : item.offset + item.length]) == item.length
        except OSError:  # absent, or unreadable: a miss
            return False
