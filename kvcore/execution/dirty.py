"""A rank's dirty slots, with tiers written back (``SupportsWriteBack``): which of its host slots hold a
chunk saved and not yet written back. A write-back, or a later op that writes the slot, ends that; what
is dirty when the worker closes, it writes back (``BlockWorker.close``), so that an engine that stops
leaves its pool's chunks on the tiers written back."""

from __future__ import annotations

import logging

from kvcore.errors import BackendError, TransferTimeout, UsageError
from kvcore.execution.runs import Items
from kvcore.model.step import WRITE_BACK_SESSION, BlockOp, RemoteChunk
from kvcore.ports import Direction, SupportsWriteBack

__all__ = ["DirtySlots"]

log = logging.getLogger(__name__)


class DirtySlots:
    """Slots of ``slot_blocks`` host blocks each, and the chunk dirty in each."""

    def __init__(self, slot_blocks: int) -> None:
        self._slot_blocks = slot_blocks
        self._chunks: dict[int, RemoteChunk] = {}  # slot -> the chunk saved into it, not yet written back

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def overwritten(self, op: BlockOp) -> None:
        """Slots the op writes (a save's, a fetch's) no longer hold the chunk that was dirty there: the
        pool gave it up, written back or dropped."""
        if op.write_back:
            return
        if op.direction is Direction.SAVE:
            for block in op.host_blocks:
                self._chunks.pop(block // self._slot_blocks, None)
        else:
            for chunk in op.remote:
                if chunk.slot is not None:
                    self._chunks.pop(chunk.slot, None)

    def published(self, op: BlockOp, chunks: tuple[RemoteChunk, ...], failed: set[int]) -> None:
        """A publish of ``chunks`` ended (``failed``: the indices among them that no tier stored): a save's
        are dirty in their slots; a write-back's are not, whatever its outcome (the scheduler counts them
        clean)."""
        for j, chunk in enumerate(chunks):
            if chunk.slot is None:
                continue
            if op.write_back:
                self._chunks.pop(chunk.slot, None)
            elif j not in failed:
                self._chunks[chunk.slot] = chunk

    def write_back(self, remote: SupportsWriteBack, items: Items, timeout: float, rank: int) -> None:
        """Write every dirty chunk back (at most ``timeout`` seconds), no longer tracked; what fails is
        logged, never raised (a worker closing)."""
        chunks, self._chunks = list(self._chunks.values()), {}
        if not chunks:
            return
        try:
            job = remote.submit_write_back(WRITE_BACK_SESSION, [items.store_item(c) for c in chunks])
            results = remote.wait([job], timeout)
        except (BackendError, UsageError, TransferTimeout) as exc:
            log.warning("kvcore: rank %d: %d chunks not written back at close: %s", rank, len(chunks), exc)
            return
        lost = len(results[0].failed_items(len(chunks))) if results else len(chunks)
        if lost:
            log.warning("kvcore: rank %d: %d of %d chunks not written back at close", rank, lost, len(chunks))
        else:
            log.info("kvcore: rank %d wrote %d chunks back at close", rank, len(chunks))
