"""``MooncakePeerTransport`` against the ``PeerTransport`` conformance suite, between two real engines."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

from kvcore.ports import MemoryRegion
from kvcore.testing.peer import PeerTransportTests
from kvcore_mooncake.pd import MooncakePeerTransport
from kvcore_mooncake.pd.transport import coalesce
from tests.mooncake_pd.conftest import EnginePool


class MooncakePeerHarness:
    """Two pooled engines; memory is numpy buffers, registered for the test and withdrawn after it."""

    def __init__(self, engines: EnginePool) -> None:
        self.producer, self.consumer = engines.take(2)
        self.consumer_name = self.consumer.address
        self._buffers: list[npt.NDArray[np.uint8]] = []
        self._local: list[MemoryRegion] = []
        self._remote: list[MemoryRegion] = []

    def _buffer(self, length: int) -> MemoryRegion:
        buffer = np.random.default_rng(len(self._buffers)).integers(0, 256, length, dtype=np.uint8)
        self._buffers.append(buffer)
        return MemoryRegion(buffer.ctypes.data, length)

    def allocate_local(self, length: int) -> int:
        region = self._buffer(length)
        self.producer.register([region])
        self._local.append(region)
        return region.address

    def allocate_remote(self, length: int) -> MemoryRegion:
        region = self._buffer(length)
        self._remote.append(region)
        return region

    def write_memory(self, address: int, data: bytes) -> None:
        ctypes.memmove(address, data, len(data))

    def read_memory(self, address: int, length: int) -> bytes:
        return ctypes.string_at(address, length)

    def close(self) -> None:
        self.producer.unregister(self._local)
        self.consumer.unregister(self._remote)


class TestMooncakePeerTransport(PeerTransportTests[MooncakePeerTransport]):
    @pytest.fixture
    def harness(self, engines: EnginePool) -> Iterator[MooncakePeerHarness]:
        with contextlib.closing(MooncakePeerHarness(engines)) as harness:
            yield harness


def test_coalesce_merges_ranges_that_touch_on_both_sides() -> None:
    # [0,10)->[100,110) and [10,20)->[110,120) merge; [20,30)->[200,210) touches only at the source
    srcs, dsts, lengths = (np.array(v, dtype=np.int64) for v in ([10, 0, 20], [110, 100, 200], [10, 10, 10]))
    merged = coalesce(srcs, dsts, lengths)
    assert [m.tolist() for m in merged] == [[0, 20], [100, 200], [20, 10]]
