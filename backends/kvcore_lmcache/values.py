"""Where the values of an LMCache job come from and go to: the worker's host buffer (the ``ManagedTier``
calls) or the engine's KV blocks (``SupportsBlockTransfer``), copied by a block mover over the server's
mapped pool.

A job resolves the server's pool once, on its own thread (``Segment``), and does every copy, header and
check of the job in it: a pool the heartbeat replaced meanwhile is still mapped (a block mover holds it),
and a header written there is harmless, since no server hands out its slots any more.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable, Sequence

from kvcore.errors import InvalidSpecError, TransferTimeout, UsageError
from kvcore.ids import ChunkKey
from kvcore.jobs import JobResult
from kvcore.ports import BlockItem, BlockTransfer, Direction, OrderedMover, StoreItem
from kvcore_lmcache.link import Segment, SlotLayout

__all__ = ["BlockValues", "HostValues", "Values"]

log = logging.getLogger(__name__)


class Values(abc.ABC):
    """A job's values: ``put`` and ``get`` copy item ``i`` into and out of the value of the slot at pool
    offset ``slot``, for each ``(i, slot)`` pair, in ``pool``, and return the items that failed."""

    def __init__(self, keys: Sequence[ChunkKey], lengths: Sequence[int]) -> None:
        self.keys = tuple(keys)
        self.lengths = tuple(lengths)  # each item's value length, as its header states it
        self._state = threading.Lock()
        self._abandoned = False  # the engine's blocks may be overwritten from now on
        self._copying = False  # a copy into engine blocks runs

    @property
    def abandoned(self) -> bool:
        with self._state:
            return self._abandoned

    def abandon(self) -> bool:
        """The engine gives the job up: no copy into its blocks starts from now on; returns whether one
        is running (``SupportsBlockTransfer.abandon``)."""
        with self._state:
            self._abandoned = True
            return self._copying

    def _start_copy_in(self) -> bool:
        """Whether a copy into engine blocks may start now (not once abandoned); it then counts as running
        until ``_end_copy_in``."""
        with self._state:
            self._copying = not self._abandoned
            return self._copying

    def _end_copy_in(self) -> None:
        with self._state:
            self._copying = False

    @abc.abstractmethod
    def put(self, pairs: Sequence[tuple[int, int]], pool: Segment) -> set[int]: ...

    @abc.abstractmethod
    def get(self, pairs: Sequence[tuple[int, int]], pool: Segment) -> set[int]: ...

    def ready(self, pool: Segment) -> bool:
        """Whether values can move to and from ``pool`` at all (checked before the server is asked)."""
        return True


class HostValues(Values):
    """Values in the worker's host buffer (``StoreItem`` offsets, or runs: a KV head's value)."""

    def __init__(
        self, host: memoryview, items: Sequence[StoreItem], layout: SlotLayout, lock: threading.Lock
    ) -> None:
        super().__init__([item.key for item in items], [item.length for item in items])
        self._host = host
        self._items = items
        self._layout = layout
        self._lock = lock  # the link's segment lock: a pool is not unmapped during a copy

    def put(self, pairs: Sequence[tuple[int, int]], pool: Segment) -> set[int]:
        return self._copy(pairs, pool, into_pool=True)

    def get(self, pairs: Sequence[tuple[int, int]], pool: Segment) -> set[int]:
        return self._copy(pairs, pool, into_pool=False)

    def _copy(self, pairs: Sequence[tuple[int, int]], pool: Segment, *, into_pool: bool) -> set[int]:
        failed: set[int] = set()
        with self._lock:
            for i, slot in pairs:
                item, at = self._items[i], self._layout.value_offset(slot)
                if pool.closed or at + item.length > pool.size:
                    failed.add(i)
                    continue
                for offset, length in item.ranges():
                    if into_pool:
                        pool.view[at : at + length] = self._host[offset : offset + length]
                    else:
                        self._host[offset : offset + length] = pool.view[at : at + length]
                    at += length
        return failed


class BlockValues(Values):
    """Values in the engine's KV blocks; a value is whole host blocks of the pool (with ``head``: that
    local KV head's head blocks, ``BlockTransfer.head``). ``mark`` orders the copies after the engine
    work queued when the job was submitted; ``mover_over`` gives the mover over a pool (``None``: none
    can be had). A copy is waited out, however long it takes (``patience`` between warnings): a job may
    not end while a copy of it can still touch an engine block."""

    def __init__(
        self,
        mark: object,
        items: Sequence[BlockItem],
        layout: SlotLayout,
        mover_over: Callable[[Segment], OrderedMover | None],
        patience: float,
        head: int | None = None,
    ) -> None:
        whole = layout.value_bytes
        super().__init__(
            [item.key for item in items],
            [whole if item.value_blocks is None else item.value_blocks * layout.align for item in items],
        )
        self._mark = mark
        self._items = items
        self._layout = layout
        self._mover_over = mover_over
        self._patience = patience
        self._head = head

    def ready(self, pool: Segment) -> bool:
        return self._mover_over(pool) is not None

    def put(self, pairs: Sequence[tuple[int, int]], pool: Segment) -> set[int]:
        return self._copy(pairs, pool, Direction.SAVE)

    def get(self, pairs: Sequence[tuple[int, int]], pool: Segment) -> set[int]:
        return self._copy(pairs, pool, Direction.LOAD)

    def _copy(self, pairs: Sequence[tuple[int, int]], pool: Segment, direction: Direction) -> set[int]:
        if not pairs:
            return set()
        owner: list[int] = []
        engine: list[int] = []
        host: list[int] = []
        for i, slot in pairs:
            item = self._items[i]
            first = self._layout.value_offset(slot) // self._layout.align + item.first
            engine.extend(item.engine_blocks)
            host.extend(range(first, first + len(item.engine_blocks)))
            owner.extend([i] * len(item.engine_blocks))
        everything = {i for i, _ in pairs}
        mover = self._mover_over(pool)
        if mover is None:
            return everything
        into_engine = direction is Direction.LOAD
        if into_engine and not self._start_copy_in():
            return everything  # given up: the engine's blocks may hold other KV now
        try:
            result = self._move(mover, BlockTransfer(direction, engine, host, self._head))
        finally:
            if into_engine:
                self._end_copy_in()
        if result is None:
            return everything
        if direction is Direction.SAVE and self.abandoned:
            return everything  # the copy may have read blocks the engine was already overwriting
        return {owner[k] for k in result.failed}

    def _move(self, mover: OrderedMover, transfer: BlockTransfer) -> JobResult | None:
        """One copy, waited out; ``None`` when it was refused or failed whole."""
        try:
            job = mover.submit_after(transfer, self._mark)
        except (InvalidSpecError, UsageError) as exc:
            log.warning("kvcore: LMCache block copy refused: %s", exc)
            return None
        while True:
            try:
                (result,) = mover.wait([job], self._patience)
                break
            except TransferTimeout:
                log.warning("kvcore: LMCache block copy still running after %.1fs", self._patience)
        if result.error is not None:
            log.warning("kvcore: LMCache block copy failed: %s", result.error)
            return None
        return result
