"""Prefix lookup: leading runs, "ask again" while pending, and every failure a miss."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcore.ids import ChunkKey
from kvcore.kit.health import CircuitBreaker
from kvcore.kit.leading import by_chunk, leading_chunks
from kvcore.scheduling.remote_lookup import PendingLookup, PrefixLookup
from kvcore.testing.memory import InMemoryChunkIndex, InMemoryStoreIndex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def remote_view(index: InMemoryChunkIndex) -> InMemoryStoreIndex:
    """The in-memory index's keys seen only through submit and poll, as a remote index answers."""
    return InMemoryStoreIndex(lambda asked: tuple(key in index for key in asked))


def keys(*names: str) -> list[tuple[ChunkKey, ...]]:
    return [(ChunkKey(n),) for n in names]


def test_leading_chunks_need_every_shard() -> None:
    # chunks of 2 shards: [T T] [T F] [T T] -> 1 (chunk 2 never counts after the gap)
    assert leading_chunks(by_chunk([True, True, True, False, True, True], [2, 2, 2]), all) == 1
    assert leading_chunks(by_chunk([], []), all) == 0


@given(st.lists(st.booleans(), max_size=40), st.integers(1, 4))
def test_leading_chunks_never_count_after_a_gap(flags: list[bool], shards: int) -> None:
    sizes = [shards] * (len(flags) // shards)
    n = leading_chunks(by_chunk(flags, sizes), all)
    assert all(flags[: n * shards])
    rest = flags[n * shards : (n + 1) * shards]
    assert len(rest) < shards or not all(rest)
    asked: list[int] = []

    def complete(i: int) -> bool:
        asked.append(i)
        return all(flags[i * shards : (i + 1) * shards])

    leading_chunks(range(len(sizes)), complete)
    assert asked == list(range(min(n + 1, len(sizes))))  # nothing asked of the chunks after the gap


def test_immediate_index_answers_at_once() -> None:
    index = InMemoryChunkIndex()
    index.add([ChunkKey("a"), ChunkKey("b"), ChunkKey("d")])
    # a b [c missing] d -> 2
    assert PrefixLookup(index, 1.0).begin(keys("a", "b", "c", "d")) == 2


def test_remote_index_ask_again_then_answer() -> None:
    index = InMemoryChunkIndex()
    index.add([ChunkKey("a")])
    remote = remote_view(index)
    lookup = PrefixLookup(remote, 1.0, clock=Clock(), threaded=False)
    with remote.stall():
        pending = lookup.begin(keys("a", "b"))
        assert isinstance(pending, PendingLookup)
        assert lookup.resume(pending) is None
    assert lookup.resume(pending) == 1


def test_preceding_chunks_reach_the_remote_index_and_are_not_counted() -> None:
    index = InMemoryChunkIndex()
    index.add([ChunkKey("a"), ChunkKey("b"), ChunkKey("c")])
    remote = remote_view(index)
    lookup = PrefixLookup(remote, 1.0, clock=Clock(), threaded=False)
    pending = lookup.begin(keys("c", "d"), keys("a", "b"))
    assert isinstance(pending, PendingLookup)
    assert [preceding for _, preceding in remote.asked] == [tuple(keys("a", "b"))]
    assert lookup.resume(pending) == 1  # c, of (c, d): a and b are not counted


def test_timeout_is_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    index = InMemoryChunkIndex()
    index.add([ChunkKey("a")])
    remote = remote_view(index)
    lookup = PrefixLookup(remote, 0.5, clock=clock, threaded=False)
    with remote.stall(), caplog.at_level(logging.WARNING):
        pending = lookup.begin(keys("a"))
        assert isinstance(pending, PendingLookup)
        clock.now = 0.6
        assert lookup.resume(pending) == 0
    assert "timed out" in caplog.text


def test_failures_trip_the_breaker_then_recover() -> None:
    clock = Clock()
    index = InMemoryChunkIndex()
    index.add([ChunkKey("a")])
    breaker = CircuitBreaker(threshold=2, backoff_s=10, clock=clock)
    remote = remote_view(index)
    lookup = PrefixLookup(remote, 1.0, breaker=breaker, clock=clock, threaded=False)
    remote.fail_next(2)
    for _ in range(2):
        pending = lookup.begin(keys("a"))
        assert isinstance(pending, PendingLookup)
        assert lookup.resume(pending) == 0
    # open: answered 0 at once, the index is not asked
    assert lookup.begin(keys("a")) == 0
    clock.now = 11
    pending = lookup.begin(keys("a"))  # the probe after the back-off
    assert isinstance(pending, PendingLookup)
    assert lookup.resume(pending) == 1
    assert not breaker.is_open


def test_garbage_answer_is_a_miss() -> None:
    class Liar:
        def lookup(self, chunks: object) -> int:
            return 99

    assert PrefixLookup(Liar(), 1.0).begin(keys("a")) == 0
