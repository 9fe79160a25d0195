"""Conformance suite for ``BlockMover``.

A backend's test module subclasses ``BlockMoverTests[MyMover]`` and defines ``make_harness``: a context
manager that yields a ``MoverHarness``, the mover plus out-of-band access to engine and host blocks in
the host block's byte form (one engine block of every layer, layer after layer).
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import pytest

from kvcore.errors import InvalidSpecError, UsageError
from kvcore.ids import JobId
from kvcore.ports import BlockMover, BlockTransfer, Direction
from kvcore.testing.support import (
    SETTLE_S,
    HarnessFixture,
    check_close,
    check_result_handed_out_once,
    check_wait_timeout_then_poll,
    payload,
    require_failure_injection,
    require_stall,
    run_threads,
    split,
    wait_one,
)

__all__ = ["BlockMoverTests", "MoverHarness", "fill_blocks", "read_engine", "read_host"]

MoverT = TypeVar("MoverT", bound=BlockMover)
MoverT_co = TypeVar("MoverT_co", bound=BlockMover, covariant=True)


class MoverHarness(Protocol[MoverT_co]):
    """The mover under test and out-of-band access to the memory it copies between.

    The suite needs at least 8 engine blocks and 8 host blocks.
    """

    @property
    def backend(self) -> MoverT_co: ...

    @property
    def num_engine_blocks(self) -> int: ...

    @property
    def num_host_blocks(self) -> int: ...

    @property
    def block_bytes(self) -> int:
        """Bytes of one host block: one engine block of every layer of the shard."""
        ...

    def read_engine_block(self, block: int) -> bytes:
        """An engine block's bytes, in the order a host block holds them."""
        ...

    def write_engine_block(self, block: int, data: bytes) -> None: ...

    def read_host_block(self, block: int) -> bytes: ...

    def write_host_block(self, block: int, data: bytes) -> None: ...


def fill_blocks(harness: MoverHarness[BlockMover], seed: str) -> tuple[list[bytes], list[bytes]]:
    """Random bytes in every engine and host block; returns what was written."""
    size = harness.block_bytes
    engine = [payload(size, (seed, "engine", b)) for b in range(harness.num_engine_blocks)]
    host = [payload(size, (seed, "host", b)) for b in range(harness.num_host_blocks)]
    for block, data in enumerate(engine):
        harness.write_engine_block(block, data)
    for block, data in enumerate(host):
        harness.write_host_block(block, data)
    return engine, host


def read_engine(harness: MoverHarness[BlockMover]) -> list[bytes]:
    return [harness.read_engine_block(b) for b in range(harness.num_engine_blocks)]


def read_host(harness: MoverHarness[BlockMover]) -> list[bytes]:
    return [harness.read_host_block(b) for b in range(harness.num_host_blocks)]


class BlockMoverTests(HarnessFixture[MoverHarness[MoverT]], Generic[MoverT]):
    """The ``BlockMover`` contract. Define ``make_harness``: a fresh ``MoverHarness`` per test."""

    def test_save_copies_blocks_bit_exact(self, harness: MoverHarness[MoverT]) -> None:
        # save engine [0, 2, 1] -> host [3, 0, 1]; host 2, 4.. untouched
        engine, host = fill_blocks(harness, "save")
        transfer = BlockTransfer(Direction.SAVE, (0, 2, 1), (3, 0, 1))
        assert wait_one(harness.backend, harness.backend.submit(transfer)).ok
        host[3], host[0], host[1] = engine[0], engine[2], engine[1]
        assert read_host(harness) == host
        assert read_engine(harness) == engine

    def test_load_copies_blocks_bit_exact(self, harness: MoverHarness[MoverT]) -> None:
        # load host [5, 0] -> engine [1, 7]; other engine blocks untouched
        engine, host = fill_blocks(harness, "load")
        transfer = BlockTransfer(Direction.LOAD, (1, 7), (5, 0))
        assert wait_one(harness.backend, harness.backend.submit(transfer)).ok
        engine[1], engine[7] = host[5], host[0]
        assert read_engine(harness) == engine
        assert read_host(harness) == host

    def test_save_then_load_round_trip(self, harness: MoverHarness[MoverT]) -> None:
        engine, _ = fill_blocks(harness, "round trip")
        blocks = (0, 1, 2, 3)
        save = harness.backend.submit(BlockTransfer(Direction.SAVE, blocks, blocks))
        assert wait_one(harness.backend, save).ok
        for block in blocks:
            harness.write_engine_block(block, payload(harness.block_bytes, ("scribble", block)))
        load = harness.backend.submit(BlockTransfer(Direction.LOAD, blocks, blocks))
        assert wait_one(harness.backend, load).ok
        assert read_engine(harness)[:4] == engine[:4]

    @pytest.mark.parametrize("side", ["engine", "host"])
    @pytest.mark.parametrize("bad", ["past the end", "negative"])
    def test_out_of_range_blocks_raise_before_copying(
        self, harness: MoverHarness[MoverT], side: str, bad: str
    ) -> None:
        engine, host = fill_blocks(harness, "range")
        bound = harness.num_engine_blocks if side == "engine" else harness.num_host_blocks
        wrong = bound if bad == "past the end" else -1
        engine_blocks, host_blocks = ((0, wrong), (0, 1)) if side == "engine" else ((0, 1), (0, wrong))
        with pytest.raises(InvalidSpecError):
            harness.backend.submit(BlockTransfer(Direction.SAVE, engine_blocks, host_blocks))
        assert read_host(harness) == host
        assert read_engine(harness) == engine

    def test_failed_items_are_reported_and_the_others_copied(self, harness: MoverHarness[MoverT]) -> None:
        # save engine [0, 1, 2] -> host [4, 5, 6], first pair fails: host 4 undefined, 5 and 6 copied
        failures = require_failure_injection(harness)
        engine, host = fill_blocks(harness, "failure")
        failures.fail_next(1)
        result = wait_one(
            harness.backend, harness.backend.submit(BlockTransfer(Direction.SAVE, (0, 1, 2), (4, 5, 6)))
        )
        assert result.failed == (0,)
        host[5], host[6] = engine[1], engine[2]
        after = read_host(harness)
        assert after[:4] + after[5:] == host[:4] + host[5:]
        assert read_engine(harness) == engine

    def test_wait_times_out_and_the_result_comes_later(self, harness: MoverHarness[MoverT]) -> None:
        stall = require_stall(harness)
        engine, _ = fill_blocks(harness, "timeout")
        check_wait_timeout_then_poll(harness.backend, stall, lambda: self._save(harness, 0, 0))
        assert harness.read_host_block(0) == engine[0]

    def test_a_result_is_handed_out_once(self, harness: MoverHarness[MoverT]) -> None:
        check_result_handed_out_once(harness.backend, lambda: self._save(harness, 0, 0))

    def test_concurrent_submits_stay_correct(self, harness: MoverHarness[MoverT]) -> None:
        # 4 threads, each saving its own engine blocks into its own host blocks, one job per block
        engine, _ = fill_blocks(harness, "threads")
        pairs = list(zip(split(harness.num_engine_blocks, 4), split(harness.num_host_blocks, 4), strict=True))
        copied: dict[int, int] = {}

        def save(thread: int) -> None:
            engine_blocks, host_blocks = pairs[thread]
            jobs = [self._save(harness, e, h) for e, h in zip(engine_blocks, host_blocks, strict=False)]
            results = harness.backend.wait(jobs, SETTLE_S)
            assert [r.job_id for r in results] == jobs
            assert all(r.ok for r in results)
            copied.update(zip(host_blocks, engine_blocks, strict=False))

        run_threads(4, save)
        assert copied
        assert all(harness.read_host_block(h) == engine[e] for h, e in copied.items())

    def test_close_refuses_new_copies_and_reports_earlier_ones(self, harness: MoverHarness[MoverT]) -> None:
        engine, _ = fill_blocks(harness, "close")
        result = check_close(
            harness.backend, harness.backend.close, lambda: self._save(harness, 0, 0), UsageError
        )
        assert not result.ok or harness.read_host_block(0) == engine[0]

    @staticmethod
    def _save(harness: MoverHarness[MoverT], engine_block: int, host_block: int) -> JobId:
        return harness.backend.submit(BlockTransfer(Direction.SAVE, (engine_block,), (host_block,)))
