"""Optional per-block checksums for the CPU tier: damaged host bytes become a miss, never a wrong token.

``ChecksummedMover`` wraps a ``BlockMover``: when a save completes it records a digest of each host block
written; before a load it checks each host block against its digest and drops the pairs that do not match
(or were never saved through it) from the copy, reporting them as failed so the engine recomputes them
and the scheduler drops their chunks. Digests are computed on the thread that polls, after the copy, so
the copy itself stays at memory speed; the cost is one BLAKE2b pass over the bytes saved and loaded.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Collection

from kvcore.ids import JobId
from kvcore.jobs import JobResult
from kvcore.kit.closing import close_quietly
from kvcore.ports import BlockMover, BlockTransfer, Direction, SupportsReopen

__all__ = ["ChecksummedMover"]


class ChecksummedMover:
    """A ``BlockMover`` that verifies host blocks with digests recorded at save time."""

    def __init__(self, inner: BlockMover, read_host_block: Callable[[int], bytes]) -> None:
        self._inner = inner
        self._read = read_host_block
        self._lock = threading.Lock()
        self._digests: dict[int, bytes] = {}
        self._saves: dict[JobId, tuple[int, ...]] = {}  # job -> host blocks written
        self._loads: dict[JobId, tuple[tuple[int, ...], int]] = {}  # job -> (kept indices, original count)
        self.mismatches = 0

    def _digest(self, host_block: int) -> bytes:
        return hashlib.blake2b(self._read(host_block), digest_size=16).digest()

    def submit(self, transfer: BlockTransfer) -> JobId:
        if transfer.direction is Direction.SAVE:
            with self._lock:
                for host in transfer.host_blocks:  # overwritten: invalid until the save completes
                    self._digests.pop(host, None)
            job = self._inner.submit(transfer)
            with self._lock:
                self._saves[job] = transfer.host_blocks
            return job
        kept = tuple(i for i, h in enumerate(transfer.host_blocks) if self._digests.get(h) == self._digest(h))
        bad = len(transfer.host_blocks) - len(kept)
        job = self._inner.submit(
            BlockTransfer(
                Direction.LOAD,
                [transfer.engine_blocks[i] for i in kept],
                [transfer.host_blocks[i] for i in kept],
            )
        )
        with self._lock:
            self.mismatches += bad
            self._loads[job] = (kept, len(transfer.host_blocks))
        return job

    def poll(self) -> tuple[JobResult, ...]:
        return self._account(self._inner.poll())

    def close(self) -> None:
        """Close the mover it wraps (its jobs still get results)."""
        close_quietly(self._inner)

    def reopen(self) -> bool:
        """``SupportsReopen``: reopen the mover it wraps, if that one can (the digests stay valid: a
        closed mover wrote no host block its failed saves did not already invalidate)."""
        return isinstance(self._inner, SupportsReopen) and self._inner.reopen()

    def wait(self, job_ids: Collection[JobId], timeout: float) -> tuple[JobResult, ...]:
        return self._account(self._inner.wait(job_ids, timeout))

    def _account(self, results: tuple[JobResult, ...]) -> tuple[JobResult, ...]:
        out = []
        for result in results:
            with self._lock:
                saved = self._saves.pop(result.job_id, None)
                load = self._loads.pop(result.job_id, None)
            if saved is not None:
                unsaved = set(result.failed) if result.error is None else set(range(len(saved)))
                digests = {h: self._digest(h) for i, h in enumerate(saved) if i not in unsaved}
                with self._lock:
                    self._digests.update(digests)
                out.append(result)
            elif load is not None:
                kept, count = load
                ok = set(kept) - {kept[i] for i in result.failed}
                if result.error is not None:
                    ok = set()
                failed = tuple(i for i in range(count) if i not in ok)
                out.append(JobResult(result.job_id, failed, result.error))
            else:
                out.append(result)
        return tuple(out)
