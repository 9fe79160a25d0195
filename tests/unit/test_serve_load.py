"""The serving benchmark's workloads and its stall figure (``benchmarks.serve_load``), without a server."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.serve_load import (
    LOAD,
    STALL_ANSWER,
    STALL_LOADS,
    STALL_LONG,
    STALL_STREAMS,
    STREAM,
    Phase,
    Record,
    Session,
    Turn,
    run_phase,
    stall,
    workload,
)


def _stream(name: str, first: float, gaps: list[float], tokens: list[int] | None = None) -> Record:
    """A stream whose first chunk came at ``first`` (it started at 0), then a chunk after each gap, of one
    token each or of ``tokens``."""
    counts = tokens or [1] * (len(gaps) + 1)
    chunks = tuple(zip(itertools.accumulate(gaps, initial=first), counts, strict=True))
    output = tuple(range(sum(counts)))
    return Record(name, 0, 8, 0.0, ttft=first, chunks=chunks, output=output)


def _load(started: float, ttft: float) -> Record:
    return Record(LOAD, 0, 3072, started, ttft=ttft, output=(1,))


def test_the_stall_is_the_longest_gap_while_the_loads_run_over_the_mean_gap_before() -> None:
    # 0.01 s between tokens; the loads run from 1.005 to 1.5; one gap of 0.05 inside, one of 0.2 after
    gaps = [0.01] * 99 + [0.05] + [0.01] * 100 + [0.2] + [0.01] * 10
    records = [_stream(f"{STREAM}0", 0.01, gaps), _load(1.005, 0.2), _load(1.2, 0.3)]
    arrivals = list(itertools.accumulate(gaps, initial=0.01))
    assert arrivals[99] < 1.005 < arrivals[100] < 1.5 < arrivals[200]  # the gap of 0.2 starts after them
    assert stall(records) == pytest.approx(5.0)


def test_the_gap_across_the_first_loads_arrival_counts_and_the_median_stream_is_the_figure() -> None:
    quiet = [0.01] * 300
    spanning = [0.01] * 95 + [0.08] + [0.01] * 200  # from 0.96 to 1.04: spans the arrival at 1.0
    records = [
        _stream(f"{STREAM}0", 0.01, quiet),
        _stream(f"{STREAM}1", 0.01, spanning),
        _stream(f"{STREAM}2", 0.01, spanning),
        _load(1.0, 0.5),
    ]
    assert stall(records) == pytest.approx(8.0)


def test_a_stall_that_ends_with_a_chunk_of_several_tokens_counts_its_whole_wait() -> None:
    # the server was held 0.3 s, then sent the tokens it had made meanwhile in one chunk
    gaps = [0.01] * 99 + [0.3] + [0.01] * 50
    tokens = [1] * 100 + [5] + [1] * 50
    records = [_stream(f"{STREAM}0", 0.01, gaps, tokens), _load(1.005, 0.5)]
    assert stall(records) == pytest.approx(30.0)


def test_no_loads_or_no_stream_before_them_is_no_figure() -> None:
    assert stall([_stream(f"{STREAM}0", 0.01, [0.01] * 10)]) == 0.0
    assert stall([_stream(f"{STREAM}0", 2.0, [0.01] * 10), _load(1.0, 0.5)]) == 0.0
    failed = Record(LOAD, 0, 3072, 1.0, error="HTTP 500")  # no first token
    assert stall([_stream(f"{STREAM}0", 0.01, [0.01] * 300), failed]) == 0.0


def test_the_stall_workload_primes_the_long_prompts_then_loads_them_among_the_streams() -> None:
    made = workload("stall", users=12, turns=1, prefix_tokens=100, turn_tokens=10, answer_tokens=4, seed=0)
    warm, prime, watched = made.phases
    assert not warm.timed
    assert not prime.timed
    (primer,) = prime.sessions
    assert [len(t.tokens) for t in primer.turns] == [STALL_LONG * 100] * STALL_LOADS
    assert watched.timed
    assert watched.reset_before
    assert watched.all_at_once
    *streams, loads = watched.sessions
    assert len(streams) == STALL_STREAMS  # at most 8 streams, whatever the clients
    assert all(s.turns[0].max_tokens == STALL_ANSWER * 4 and not s.start_after_tokens for s in streams)
    assert loads.name == LOAD
    assert loads.turns == primer.turns
    assert 0 < loads.start_after_tokens < STALL_ANSWER * 4


def test_a_session_that_waits_for_others_needs_every_session_at_once() -> None:
    waits = Session("loads", (Turn((1, 2), 1),), start_after_tokens=4)
    streams = Session(f"{STREAM}0", (Turn((1, 2), 8),))
    with pytest.raises(ValueError, match="at once"):  # a waiting session could hold the only client
        run_phase("http://127.0.0.1:9", Phase((waits, streams)), clients=1)
