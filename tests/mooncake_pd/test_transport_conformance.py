"""``MooncakePeerTransport`` against the ``PeerTransport`` conformance suite, between two real engines."""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt
import pytest

from kvcore.ports import MemoryRegion
from kvcore.testing.peer import PeerTransportTests
from kvcore_mooncake.pd import MooncakePeerTransport
from kvcore_mooncake.pd.transport import coalesce
from tests.mooncake_pd.conftest import MooncakePeers


class MooncakePeerHarness:
    """Two fresh transports over pooled engines; memory is numpy buffers. Closing the transports after
    the test withdraws what it registered."""

    def __init__(self, peers: MooncakePeers) -> None:
        self.producer, self.consumer = peers.take(2)
        self.consumer_name = self.consumer.address
        self._buffers: list[npt.NDArray[np.uint8]] = []

    def _buffer(self, length: int) -> MemoryRegion:
        buffer = np.random.default_rng(len(self._buffers)).integers(0, 256, length, dtype=np.uint8)
        self._buffers.append(buffer)
        return MemoryRegion(buffer.ctypes.data, length)

    def allocate_local(self, length: int) -> int:
        region = self._buffer(length)
        self.producer.register([region])
        return region.address

    def allocate_remote(self, length: int) -> MemoryRegion:
        return self._buffer(length)

    def write_memory(self, address: int, data: bytes) -> None:
        ctypes.memmove(address, data, len(data))

    def read_memory(self, address: int, length: int) -> bytes:
        return ctypes.string_at(address, length)


class TestMooncakePeerTransport(PeerTransportTests[MooncakePeerTransport]):
    @pytest.fixture
    def harness(self, mooncake: MooncakePeers) -> MooncakePeerHarness:
        return MooncakePeerHarness(mooncake)


def test_coalesce_merges_ranges_that_touch_on_both_sides() -> None:
    # [0,10)->[100,110) and [10,20)->[110,120) merge; [20,30)->[200,210) touches only at the source
    srcs, dsts, lengths = (np.array(v, dtype=np.int64) for v in ([10, 0, 20], [110, 100, 200], [10, 10, 10]))
    merged = coalesce(srcs, dsts, lengths)
    assert [m.tolist() for m in merged] == [[0, 20], [100, 200], [20, 10]]
