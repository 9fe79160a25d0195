"""Conformance suite for ``SupportsBlockTransfer``: a managed tier that moves chunks straight between
engine blocks and its own memory.

A backend's test module subclasses ``BlockTransferTests[MyTier]`` (next to ``ManagedTierTests[MyTier]``
where its harness serves both) and defines ``make_harness``: a context manager that yields a
``BlockTransferHarness``, the tier, ``peek``/``poke`` of its values as for ``ManagedHarness``, and
out-of-band access to the engine blocks it copies. A value is ``blocks_per_chunk`` engine blocks in the
byte form of host blocks (one engine block of every layer, layer after layer), one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Generic, Protocol, TypeVar

import pytest

from kvcore.errors import BackendUnavailable, InvalidSpecError
from kvcore.ids import ChunkKey, JobId, RequestId
from kvcore.jobs import JobResult
from kvcore.ports import BlockItem, SupportsBlockTransfer
from kvcore.testing.managed import new_session
from kvcore.testing.support import (
    HarnessFixture,
    check_close,
    fresh_keys,
    payload,
    require_failure_injection,
    require_stall,
    settle,
    wait_one,
)

__all__ = ["BlockTransferHarness", "BlockTransferTests"]

TierT = TypeVar("TierT", bound=SupportsBlockTransfer)
TierT_co = TypeVar("TierT_co", bound=SupportsBlockTransfer, covariant=True)


class BlockTransferHarness(Protocol[TierT_co]):
    """The tier, its values out of band, and the engine blocks it copies.

    The suite needs at least ``4 * blocks_per_chunk`` engine blocks.
    """

    @property
    def backend(self) -> TierT_co: ...

    @property
    def num_engine_blocks(self) -> int: ...

    @property
    def block_bytes(self) -> int:
        """Bytes of one engine block in host-block form: one block of every layer of the shard."""
        ...

    @property
    def blocks_per_chunk(self) -> int: ...

    def read_engine_block(self, block: int) -> bytes: ...

    def write_engine_block(self, block: int, data: bytes) -> None: ...

    def peek(self, key: ChunkKey, preceding: Sequence[ChunkKey] = ()) -> bytes | None:
        """The value the tier holds under ``key`` after ``preceding``; ``None`` if absent."""
        ...

    def poke(self, key: ChunkKey, value: bytes, preceding: Sequence[ChunkKey] = ()) -> None:
        """Make the tier hold ``value`` under ``key`` after ``preceding``, without the backend."""
        ...


def _chunk(harness: BlockTransferHarness[SupportsBlockTransfer], n: int) -> tuple[int, ...]:
    """The engine blocks of the ``n``-th chunk's worth of blocks."""
    size = harness.blocks_per_chunk
    return tuple(range(n * size, (n + 1) * size))


def _fill(harness: BlockTransferHarness[SupportsBlockTransfer], seed: str) -> list[bytes]:
    """Random bytes in every engine block; returns what was written."""
    engine = [payload(harness.block_bytes, (seed, b)) for b in range(harness.num_engine_blocks)]
    for block, data in enumerate(engine):
        harness.write_engine_block(block, data)
    return engine


def _engine(harness: BlockTransferHarness[SupportsBlockTransfer]) -> list[bytes]:
    return [harness.read_engine_block(b) for b in range(harness.num_engine_blocks)]


def _joined(engine: Sequence[bytes], blocks: Sequence[int]) -> bytes:
    return b"".join(engine[b] for b in blocks)


class BlockTransferTests(HarnessFixture[BlockTransferHarness[TierT]], Generic[TierT]):
    """The ``SupportsBlockTransfer`` contract. Define ``make_harness``: a fresh harness per test."""

    @staticmethod
    def _lock_hits(
        harness: BlockTransferHarness[TierT], session: RequestId, keys: Sequence[ChunkKey]
    ) -> None:
        """Look ``keys`` up for ``session``, as the scheduler does before a retrieve."""
        lookup_id = harness.backend.submit_lookup(session, keys)
        settle(partial(harness.backend.poll_lookup, lookup_id), f"lookup {lookup_id}")

    @staticmethod
    def _store_chunks(
        harness: BlockTransferHarness[TierT], keys: Sequence[ChunkKey]
    ) -> tuple[JobId, JobResult]:
        """Store chunk ``i``'s engine blocks under ``keys[i]``, as one chain."""
        items = [BlockItem(key, _chunk(harness, i)) for i, key in enumerate(keys)]
        job = harness.backend.submit_store_blocks(new_session("store-blocks"), items)
        return job, wait_one(harness.backend, job)

    def _retrieve_chunks(
        self, harness: BlockTransferHarness[TierT], items: Sequence[BlockItem], chain: Sequence[ChunkKey]
    ) -> JobResult:
        session = new_session("retrieve-blocks")
        self._lock_hits(harness, session, chain)
        job = harness.backend.submit_retrieve_blocks(session, items, chain)
        result = wait_one(harness.backend, job)
        harness.backend.end_session(session)
        return result

    def test_store_then_retrieve_blocks_round_trip_is_bit_exact(
        self, harness: BlockTransferHarness[TierT]
    ) -> None:
        # chunks 0, 1 stored as [a, b]; retrieved into chunks 2, 3; every other block untouched
        engine = _fill(harness, "round trip")
        keys = fresh_keys(2)
        assert self._store_chunks(harness, keys)[1].ok
        values = [_joined(engine, _chunk(harness, i)) for i in range(2)]
        assert [harness.peek(key, keys[:i]) for i, key in enumerate(keys)] == values
        targets = [BlockItem(key, _chunk(harness, i + 2)) for i, key in enumerate(keys)]
        assert self._retrieve_chunks(harness, targets, keys).ok
        for i in range(2):
            for n, block in enumerate(_chunk(harness, i + 2)):
                engine[block] = engine[_chunk(harness, i)[n]]
        assert _engine(harness) == engine

    def test_retrieve_of_part_of_a_chunk_copies_those_blocks_only(
        self, harness: BlockTransferHarness[TierT]
    ) -> None:
        # the chunk's last block -> engine block 0
        (key,) = fresh_keys(1)
        size, last = harness.block_bytes, harness.blocks_per_chunk - 1
        value = payload(size * harness.blocks_per_chunk, key)
        harness.poke(key, value)
        engine = _fill(harness, "part")
        assert self._retrieve_chunks(harness, [BlockItem(key, (0,), first=last)], [key]).ok
        engine[0] = value[last * size :]
        assert _engine(harness) == engine

    def test_a_tail_round_trips_after_its_chain_and_a_value_is_read_at_its_own_size_only(
        self, harness: BlockTransferHarness[TierT]
    ) -> None:
        # chain [chunk, tail]: chunk 0's blocks, then the leading blocks of chunk 1 as a value of its own
        size = harness.blocks_per_chunk
        if size < 2:
            pytest.skip("a chunk of one block has no tail")
        engine = _fill(harness, "tail")
        chunk, tail = fresh_keys(2)
        lead = _chunk(harness, 1)[: size - 1]
        items = [BlockItem(chunk, _chunk(harness, 0)), BlockItem(tail, lead, value_blocks=size - 1)]
        job = harness.backend.submit_store_blocks(new_session("tail"), items, [chunk, tail])
        assert wait_one(harness.backend, job).ok
        assert harness.peek(tail, [chunk]) == _joined(engine, lead)
        first = 1 if size > 2 else 0  # from the tail's block 1 on where it has two: a load that starts in it
        into = _chunk(harness, 2)[: size - 1 - first]
        assert self._retrieve_chunks(harness, [BlockItem(tail, into, first, size - 1)], [chunk, tail]).ok
        for n, block in enumerate(into):
            engine[block] = engine[lead[first + n]]
        assert _engine(harness) == engine
        # the tail's key read as a whole chunk, and the chunk's as a tail: failed items, never bytes
        whole = BlockItem(tail, _chunk(harness, 3))
        assert self._retrieve_chunks(harness, [whole], [chunk, tail]).failed == (0,)
        short = BlockItem(chunk, _chunk(harness, 3)[: size - 1], value_blocks=size - 1)
        assert self._retrieve_chunks(harness, [short], [chunk]).failed == (0,)

    def test_block_retrieve_of_a_missing_key_is_a_failed_item(
        self, harness: BlockTransferHarness[TierT]
    ) -> None:
        # [a, missing] -> failed (1,); a copied into chunk 0
        a, missing = fresh_keys(2)
        value = payload(harness.block_bytes * harness.blocks_per_chunk, a)
        harness.poke(a, value)
        _fill(harness, "missing")
        items = [BlockItem(a, _chunk(harness, 0)), BlockItem(missing, _chunk(harness, 1))]
        assert self._retrieve_chunks(harness, items, [a, missing]).failed == (1,)
        assert _joined(_engine(harness), _chunk(harness, 0)) == value

    def test_a_store_of_part_of_a_chunk_is_refused(self, harness: BlockTransferHarness[TierT]) -> None:
        (key,) = fresh_keys(1)
        with pytest.raises(InvalidSpecError):
            harness.backend.submit_store_blocks(new_session("part"), [BlockItem(key, _chunk(harness, 0), 1)])
        assert harness.peek(key) is None

    def test_failed_block_store_item_is_not_stored(self, harness: BlockTransferHarness[TierT]) -> None:
        failures = require_failure_injection(harness)
        engine = _fill(harness, "failed store")
        a, b = fresh_keys(2)
        failures.fail_next(1)
        assert self._store_chunks(harness, [a, b])[1].failed == (0,)
        assert harness.peek(a) is None
        assert harness.peek(b, [a]) == _joined(engine, _chunk(harness, 1))

    def test_an_abandoned_block_store_stores_nothing(self, harness: BlockTransferHarness[TierT]) -> None:
        stall = require_stall(harness)
        _fill(harness, "abandoned")
        (key,) = fresh_keys(1)
        with stall.stall():
            job = harness.backend.submit_store_blocks(
                new_session("abandon"), [BlockItem(key, _chunk(harness, 0))]
            )
            assert not harness.backend.abandon(job)  # a store copies nothing into engine blocks
            _fill(harness, "overwritten")
        assert not wait_one(harness.backend, job).ok
        assert harness.peek(key) is None

    def test_an_abandoned_block_retrieve_writes_no_engine_block(
        self, harness: BlockTransferHarness[TierT]
    ) -> None:
        # a retrieve given up before its copy started: none starts, its items fail, the blocks keep
        # what the engine wrote there meanwhile (another request's KV)
        stall = require_stall(harness)
        (key,) = fresh_keys(1)
        harness.poke(key, payload(harness.block_bytes * harness.blocks_per_chunk, key))
        session = new_session("abandon-retrieve")
        self._lock_hits(harness, session, [key])
        with stall.stall():
            job = harness.backend.submit_retrieve_blocks(session, [BlockItem(key, _chunk(harness, 0))], [key])
            assert not harness.backend.abandon(job)  # nothing was copying
            engine = _fill(harness, "the blocks' new owner")
        assert wait_one(harness.backend, job).failed == (0,)
        assert _engine(harness) == engine
        harness.backend.end_session(session)
        again = [BlockItem(key, _chunk(harness, 1))]
        assert self._retrieve_chunks(harness, again, [key]).ok  # the value is still there

    def test_abandon_of_a_finished_or_unknown_block_store_changes_nothing(
        self, harness: BlockTransferHarness[TierT]
    ) -> None:
        engine = _fill(harness, "finished")
        (key,) = fresh_keys(1)
        job, result = self._store_chunks(harness, [key])
        assert result.ok
        assert not harness.backend.abandon(job)
        assert not harness.backend.abandon(JobId(2**62))
        assert harness.peek(key) == _joined(engine, _chunk(harness, 0))
        retrieved = self._retrieve_chunks(harness, [BlockItem(key, _chunk(harness, 1))], [key])
        assert retrieved.ok
        assert not harness.backend.abandon(retrieved.job_id)  # finished: no copy runs

    def test_close_refuses_block_jobs_and_reports_earlier_ones(
        self, harness: BlockTransferHarness[TierT]
    ) -> None:
        engine = _fill(harness, "close")
        (key,) = fresh_keys(1)
        session = new_session("close-blocks")
        items = [BlockItem(key, _chunk(harness, 0))]
        result = check_close(
            harness.backend,
            harness.backend.close,
            lambda: harness.backend.submit_store_blocks(session, items),
            BackendUnavailable,
        )
        assert harness.peek(key) == (_joined(engine, _chunk(harness, 0)) if result.ok else None)
        with pytest.raises(BackendUnavailable, match="closed"):
            harness.backend.submit_retrieve_blocks(session, items)
