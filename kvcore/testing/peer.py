"""Conformance suite for ``PeerTransport``.

A backend's test module subclasses ``PeerTransportTests[MyTransport]`` and defines ``make_harness``: a
context manager that yields a ``PeerHarness``, a producer and a consumer transport in one process and
out-of-band access to the memory of both. The transports are the test's own: some tests close them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import pytest

from kvcore.errors import BackendError, InvalidSpecError, UsageError
from kvcore.ids import JobId
from kvcore.jobs import JobResult
from kvcore.ports import ByteCopy, MemoryRegion, PeerTransport
from kvcore.testing.support import (
    SETTLE_S,
    HarnessFixture,
    check_result_handed_out_once,
    check_wait_timeout_then_poll,
    payload,
    require_failure_injection,
    require_stall,
    run_threads,
    wait_one,
)

__all__ = ["PeerHarness", "PeerTransportTests"]

PeerT = TypeVar("PeerT", bound=PeerTransport)
PeerT_co = TypeVar("PeerT_co", bound=PeerTransport, covariant=True)


class PeerHarness(Protocol[PeerT_co]):
    """A producer that writes, a consumer that registers memory, and out-of-band access to both."""

    @property
    def producer(self) -> PeerT_co: ...

    @property
    def consumer(self) -> PeerT_co: ...

    @property
    def consumer_name(self) -> str:
        """The peer name under which the producer reaches the consumer (its ``address``)."""
        ...

    def allocate_local(self, length: int) -> int:
        """Producer memory that the producer may copy from (registered, if it must be); its address."""
        ...

    def allocate_remote(self, length: int) -> MemoryRegion:
        """Consumer memory, not yet registered."""
        ...

    def write_memory(self, address: int, data: bytes) -> None: ...

    def read_memory(self, address: int, length: int) -> bytes: ...


class PeerTransportTests(HarnessFixture[PeerHarness[PeerT]], Generic[PeerT]):
    """The ``PeerTransport`` contract. Define ``make_harness``: a fresh ``PeerHarness`` per test."""

    @staticmethod
    def _registered(harness: PeerHarness[PeerT], length: int) -> MemoryRegion:
        region = harness.allocate_remote(length)
        harness.consumer.register([region])
        return region

    @staticmethod
    def _source(harness: PeerHarness[PeerT], data: bytes) -> int:
        address = harness.allocate_local(len(data))
        harness.write_memory(address, data)
        return address

    @staticmethod
    def _write_or_refuse(
        harness: PeerHarness[PeerT], peer: str, copies: Sequence[ByteCopy]
    ) -> JobResult | None:
        """The write's result, or ``None`` when the producer refused it at submit."""
        try:
            job = harness.producer.submit_write(peer, copies)
        except (InvalidSpecError, BackendError):
            return None
        return wait_one(harness.producer, job)

    def test_write_is_bit_exact(self, harness: PeerHarness[PeerT]) -> None:
        # source bytes [0, 100) -> dst [0, 100); [100, 300) -> dst [250, 450); the rest untouched
        region = self._registered(harness, 512)
        expected = bytearray(harness.read_memory(region.address, 512))
        data = payload(300, "write")
        src = self._source(harness, data)
        copies = [ByteCopy(src, region.address, 100), ByteCopy(src + 100, region.address + 250, 200)]
        assert wait_one(harness.producer, harness.producer.submit_write(harness.consumer_name, copies)).ok
        expected[0:100], expected[250:450] = data[:100], data[100:]
        assert harness.read_memory(region.address, 512) == expected

    def test_register_adds_to_what_is_registered(self, harness: PeerHarness[PeerT]) -> None:
        first, second = self._registered(harness, 64), self._registered(harness, 64)
        data = payload(64, "register")
        src = self._source(harness, data)
        copies = [ByteCopy(src, first.address, 64), ByteCopy(src, second.address, 64)]
        assert wait_one(harness.producer, harness.producer.submit_write(harness.consumer_name, copies)).ok
        assert [harness.read_memory(r.address, 64) for r in (first, second)] == [data, data]

    def test_write_to_unregistered_memory_fails_and_writes_nothing(self, harness: PeerHarness[PeerT]) -> None:
        self._registered(harness, 256)
        unregistered = harness.allocate_remote(256)
        before = harness.read_memory(unregistered.address, 256)
        src = self._source(harness, payload(64, "unregistered"))
        result = self._write_or_refuse(
            harness, harness.consumer_name, [ByteCopy(src, unregistered.address, 64)]
        )
        assert result is None or result.failed == (0,)
        assert harness.read_memory(unregistered.address, 256) == before

    def test_write_past_the_end_of_a_region_fails(self, harness: PeerHarness[PeerT]) -> None:
        region = self._registered(harness, 256)
        src = self._source(harness, payload(100, "straddle"))
        result = self._write_or_refuse(
            harness, harness.consumer_name, [ByteCopy(src, region.address + 200, 100)]
        )
        assert result is None or result.failed == (0,)

    def test_write_to_an_unknown_peer_fails(self, harness: PeerHarness[PeerT]) -> None:
        src = self._source(harness, payload(64, "unknown"))
        copies = [ByteCopy(src, src, 32), ByteCopy(src + 32, src, 32)]
        result = self._write_or_refuse(harness, f"no-such-peer-{uuid.uuid4().hex}", copies)
        assert result is None or result.failed == (0, 1)

    def test_failed_copies_are_reported_and_the_others_written(self, harness: PeerHarness[PeerT]) -> None:
        failures = require_failure_injection(harness)
        region = self._registered(harness, 128)
        data = payload(128, "failure")
        src = self._source(harness, data)
        copies = [ByteCopy(src, region.address, 64), ByteCopy(src + 64, region.address + 64, 64)]
        failures.fail_next(1)
        result = wait_one(harness.producer, harness.producer.submit_write(harness.consumer_name, copies))
        assert result.failed == (0,)
        assert harness.read_memory(region.address + 64, 64) == data[64:]

    def test_wait_times_out_and_the_result_comes_later(self, harness: PeerHarness[PeerT]) -> None:
        stall = require_stall(harness)
        region = self._registered(harness, 64)
        data = payload(64, "timeout")
        copies = [ByteCopy(self._source(harness, data), region.address, 64)]
        check_wait_timeout_then_poll(
            harness.producer, stall, lambda: harness.producer.submit_write(harness.consumer_name, copies)
        )
        assert harness.read_memory(region.address, 64) == data

    def test_a_result_is_handed_out_once(self, harness: PeerHarness[PeerT]) -> None:
        region = self._registered(harness, 64)
        copies = [ByteCopy(self._source(harness, b"x" * 64), region.address, 64)]
        check_result_handed_out_once(
            harness.producer, lambda: harness.producer.submit_write(harness.consumer_name, copies)
        )

    def test_concurrent_writes_stay_correct(self, harness: PeerHarness[PeerT]) -> None:
        # 4 threads, each writing its own quarter of one region, 64 bytes a job
        region = self._registered(harness, 4 * 256)
        data = payload(4 * 256, "threads")
        src = self._source(harness, data)

        def write_quarter(thread: int) -> None:
            offsets = range(thread * 256, (thread + 1) * 256, 64)
            jobs: list[JobId] = [
                harness.producer.submit_write(
                    harness.consumer_name, [ByteCopy(src + offset, region.address + offset, 64)]
                )
                for offset in offsets
            ]
            results = harness.producer.wait(jobs, SETTLE_S)
            assert [r.job_id for r in results] == jobs
            assert all(r.ok for r in results)

        run_threads(4, write_quarter)
        assert harness.read_memory(region.address, 4 * 256) == data

    def test_a_transport_is_reached_by_its_address(self, harness: PeerHarness[PeerT]) -> None:
        region = self._registered(harness, 64)
        data = payload(64, "address")
        copies = [ByteCopy(self._source(harness, data), region.address, 64)]
        assert wait_one(harness.producer, harness.producer.submit_write(harness.consumer.address, copies)).ok
        assert harness.read_memory(region.address, 64) == data

    def test_columns_write_what_copies_write(self, harness: PeerHarness[PeerT]) -> None:
        # the copies of test_write_is_bit_exact, as columns: [0, 100) -> [0, 100), [100, 300) -> [250, 450)
        region = self._registered(harness, 512)
        expected = bytearray(harness.read_memory(region.address, 512))
        data = payload(300, "columns")
        src = self._source(harness, data)
        job = harness.producer.submit_write_columns(
            harness.consumer_name, [src, src + 100], [region.address, region.address + 250], [100, 200]
        )
        assert wait_one(harness.producer, job).ok
        expected[0:100], expected[250:450] = data[:100], data[100:]
        assert harness.read_memory(region.address, 512) == expected

    def test_failed_columns_are_reported_by_index(self, harness: PeerHarness[PeerT]) -> None:
        failures = require_failure_injection(harness)
        region = self._registered(harness, 128)
        data = payload(128, "column failure")
        src = self._source(harness, data)
        failures.fail_next(1)
        job = harness.producer.submit_write_columns(
            harness.consumer_name, [src, src + 64], [region.address, region.address + 64], [64, 64]
        )
        assert wait_one(harness.producer, job).failed == (0,)
        assert harness.read_memory(region.address + 64, 64) == data[64:]

    def test_columns_of_different_lengths_are_refused(self, harness: PeerHarness[PeerT]) -> None:
        region = self._registered(harness, 64)
        src = self._source(harness, payload(64, "ragged"))
        with pytest.raises(InvalidSpecError, match="srcs, dsts and lengths"):
            harness.producer.submit_write_columns(
                harness.consumer_name, [src, src + 32], [region.address], [32]
            )

    def test_unregistered_memory_is_written_no_more(self, harness: PeerHarness[PeerT]) -> None:
        region = self._registered(harness, 128)
        harness.consumer.unregister([region])
        before = harness.read_memory(region.address, 128)
        src = self._source(harness, payload(64, "withdrawn"))
        result = self._write_or_refuse(harness, harness.consumer_name, [ByteCopy(src, region.address, 64)])
        assert result is None or result.failed == (0,)
        assert harness.read_memory(region.address, 128) == before

    def test_unregister_keeps_other_regions_and_ignores_unknown_ones(
        self, harness: PeerHarness[PeerT]
    ) -> None:
        kept, dropped = self._registered(harness, 64), self._registered(harness, 64)
        harness.consumer.unregister([dropped, harness.allocate_remote(64)])
        data = payload(64, "kept")
        copies = [ByteCopy(self._source(harness, data), kept.address, 64)]
        assert wait_one(harness.producer, harness.producer.submit_write(harness.consumer_name, copies)).ok
        assert harness.read_memory(kept.address, 64) == data

    def test_close_refuses_new_work_and_reports_earlier_jobs(self, harness: PeerHarness[PeerT]) -> None:
        region = self._registered(harness, 64)
        data = payload(64, "close")
        src = self._source(harness, data)
        copies = [ByteCopy(src, region.address, 64)]
        job = harness.producer.submit_write(harness.consumer_name, copies)
        harness.producer.close()
        harness.producer.close()
        (result,) = harness.producer.wait([job], SETTLE_S)
        assert result.failed == (0,) or harness.read_memory(region.address, 64) == data
        with pytest.raises(UsageError, match="closed"):
            harness.producer.submit_write(harness.consumer_name, copies)
        with pytest.raises(UsageError, match="closed"):
            harness.producer.submit_write_columns(harness.consumer_name, [src], [region.address], [64])
        with pytest.raises(UsageError, match="closed"):
            harness.producer.register([harness.allocate_remote(64)])
        harness.producer.unregister([region])
        assert harness.producer.poll() == ()

    def test_close_withdraws_every_registration(self, harness: PeerHarness[PeerT]) -> None:
        region = self._registered(harness, 64)
        before = harness.read_memory(region.address, 64)
        harness.consumer.close()
        harness.consumer.unregister([region])
        src = self._source(harness, payload(64, "closed peer"))
        result = self._write_or_refuse(harness, harness.consumer_name, [ByteCopy(src, region.address, 64)])
        assert result is None or result.failed == (0,)
        assert harness.read_memory(region.address, 64) == before
