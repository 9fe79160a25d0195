"""Conformance suite for ``OrderedMover``: what a ``BlockMover`` adds when its copies may be submitted
from a thread other than the engine's.

A backend's test module subclasses ``OrderedMoverTests[MyMover]`` next to ``BlockMoverTests[MyMover]``
(one class may take both) and defines ``make_harness`` as for that suite: a ``MoverHarness``, whose
out-of-band writes to engine blocks are the engine's work, done before the test takes a mark.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import pytest

from kvcore.errors import InvalidSpecError, UsageError
from kvcore.ids import JobId
from kvcore.ports import BlockTransfer, Direction, OrderedMover
from kvcore.testing.mover import MoverHarness, fill_blocks, read_engine, read_host
from kvcore.testing.support import SETTLE_S, HarnessFixture, run_threads, wait_one

__all__ = ["OrderedMoverTests"]

OrderedT = TypeVar("OrderedT", bound=OrderedMover)


class OrderedMoverTests(HarnessFixture[MoverHarness[OrderedT]], Generic[OrderedT]):
    """The ``OrderedMover`` contract. Define ``make_harness``: a fresh ``MoverHarness`` per test."""

    @staticmethod
    def _submit_elsewhere(harness: MoverHarness[OrderedT], transfer: BlockTransfer, mark: object) -> JobId:
        """``submit_after`` called on a thread of its own, as a backend's copy thread calls it."""
        jobs: list[JobId] = []
        run_threads(1, lambda _: jobs.append(harness.backend.submit_after(transfer, mark)))
        return jobs[0]

    @pytest.mark.parametrize("direction", [Direction.SAVE, Direction.LOAD])
    def test_a_copy_after_a_mark_from_another_thread_is_bit_exact(
        self, harness: MoverHarness[OrderedT], direction: Direction
    ) -> None:
        # engine [0, 3, 5] <-> host [2, 7, 1], the mark taken on the test thread after the engine wrote
        engine, host = fill_blocks(harness, f"ordered {direction.value}")
        mark = harness.backend.mark()
        transfer = BlockTransfer(direction, (0, 3, 5), (2, 7, 1))
        assert wait_one(harness.backend, self._submit_elsewhere(harness, transfer, mark)).ok
        for e, h in zip(transfer.engine_blocks, transfer.host_blocks, strict=True):
            if direction is Direction.SAVE:
                host[h] = engine[e]
            else:
                engine[e] = host[h]
        assert read_host(harness) == host
        assert read_engine(harness) == engine

    def test_one_mark_orders_many_copies(self, harness: MoverHarness[OrderedT]) -> None:
        engine, _ = fill_blocks(harness, "one mark")
        mark = harness.backend.mark()
        jobs = [
            harness.backend.submit_after(BlockTransfer(Direction.SAVE, (b,), (b,)), mark) for b in range(4)
        ]
        assert [r.ok for r in harness.backend.wait(jobs, SETTLE_S)] == [True] * 4
        assert read_host(harness)[:4] == engine[:4]

    def test_submit_after_refuses_bad_blocks_before_copying(self, harness: MoverHarness[OrderedT]) -> None:
        engine, host = fill_blocks(harness, "ordered range")
        transfer = BlockTransfer(Direction.SAVE, (0, harness.num_engine_blocks), (0, 1))
        with pytest.raises(InvalidSpecError):
            harness.backend.submit_after(transfer, harness.backend.mark())
        assert read_host(harness) == host
        assert read_engine(harness) == engine

    def test_submit_after_is_refused_after_close(self, harness: MoverHarness[OrderedT]) -> None:
        mark = harness.backend.mark()
        harness.backend.close()
        with pytest.raises(UsageError, match="closed"):
            harness.backend.submit_after(BlockTransfer(Direction.SAVE, (0,), (0,)), mark)
        assert harness.backend.poll() == ()
