"""The worker side: a ``ChunkStore`` that moves chunk values between the rank's host pool and files."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from kvcore.ids import ChunkKey
from kvcore.jobs import JobResult
from kvcore.kit.faults import FaultHooks, leading_failures
from kvcore.kit.lane_store import LaneStore, StoreJob
from kvcore.ports import Direction, StoreItem
from kvcore_dirstore.files import chunk_path, write_atomically

__all__ = ["DirChunkStore"]

log = logging.getLogger(__name__)


class DirChunkStore(LaneStore):
    """Chunk values as files under ``root``, copied to and from ``host`` (the rank's host pool).

    The job half is the kit's ``LaneStore``: items are checked against the host pool before anything is
    queued (``InvalidSpecError``), jobs run on a ``JobLane`` thread (gets before queued puts), a job whose
    code raises fails alone, and ``close`` refuses new jobs (``UsageError``) and fails the queued ones.
    This class adds what is the files' own: ``exists``, ``remove``, ``clear`` and running one job.
    ``faults`` (``kvcore.kit.faults``), if given, run before each job: a test fails or stalls it there.
    """

    def __init__(self, root: Path, host: memoryview, *, faults: FaultHooks | None = None) -> None:
        self._root = root
        self._host = host.cast("B")
        self._faults = faults
        super().__init__("dirstore", len(self._host))
        root.mkdir(parents=True, exist_ok=True)

    def exists(self, keys: Sequence[ChunkKey]) -> tuple[bool, ...]:
        return tuple(chunk_path(self._root, key).is_file() for key in keys)

    def remove(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            chunk_path(self._root, key).unlink(missing_ok=True)

    def clear(self) -> None:
        """Drop every chunk (``SupportsClear``); the jobs queued before fail, so that no put in flight
        brings a value back."""
        with self._io:
            self._clear_queued()
            for path in self._root.iterdir():
                path.unlink(missing_ok=True)

    def _run(self, job: StoreJob) -> JobResult:
        """One job, on the lane's thread: its leading items the fault hooks fail, then each file."""
        skip = leading_failures(self._faults, Direction.SAVE if job.put else Direction.LOAD, len(job.items))
        move = self._put if job.put else self._get
        failed = tuple(i for i, item in enumerate(job.items) if i < skip or not move(item))
        return JobResult(job.job_id, failed)

    def _closed_lane(self, timeout: float) -> None:
        """Nothing else to release: the files stay."""

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
