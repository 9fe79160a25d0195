"""The lifecycle fuzzer (``kvcore fuzz``): short seeded runs with and without a remote tier (the in-memory
reference store, or the disk tier's real store) must pass every check after every step, and must really
exercise the lifecycle (so that this test fails if the fuzzer stopped loading, preempting, resetting or
injecting faults); a seed replays exactly."""

from __future__ import annotations

import pytest

from kvcore_cli.fuzz import FuzzFailure, FuzzOptions, FuzzSummary, run_fuzz
from kvcore_cli.main import main

SEEDS = (1, 2, 3)
STEPS = 200


@pytest.mark.parametrize(
    "options",
    [
        FuzzOptions(),
        FuzzOptions(remote=True),
        FuzzOptions(disk=True),
        FuzzOptions(stack=True),
        FuzzOptions(stack=True, write_back=True, pool_slots=8, cross_tp=True),
        FuzzOptions(disk=True, cross_tp=True),
        FuzzOptions(window=3),
        FuzzOptions(remote=True, window=2),
    ],
    # disk: the disk tier's real store (files in a temporary directory); stack: it, then a memory store;
    # write-back: the disk written back from a small pool (so chunks are written back and fetched again),
    # and read after the run at TP 2 or 4 (what reached the disk was written back); cross-tp: the disk
    # written through, read after the run at TP 2 or 4; window: a sliding-window model (blocks given back
    # mid-request, loads of the hit's last window)
    ids=["cpu", "remote", "disk", "stack", "write-back", "cross-tp", "window", "window-remote"],
)
def test_seeded_runs_hold_every_check_and_cover_the_lifecycle(options: FuzzOptions) -> None:
    runs = [run_fuzz(seed, STEPS, options) for seed in SEEDS]

    def total(field: str) -> int:
        return sum(getattr(run, field) for run in runs)

    assert total("loads_checked") > 0
    # loads of several blocks, on average; a sliding window's hold the hit's last window alone
    assert total("blocks_verified") > (0 if options.window else total("loads_checked"))
    assert total("blocks_recomputed") > 0  # failed or lost loads were reported and recomputed
    assert total("preemptions") > 0
    assert total("resets") > 0
    assert total("aborted") > 0
    assert total("hash_lookups") > 0
    assert total("hash_lookups") < total("lookups")  # lookups by tokens too
    assert total("loads_given_up") > 0  # late loads recomputed while their copies were in flight
    assert total("mover_faults") > 0
    assert total("late_jobs") > 0
    assert total("evictions") > 0
    if options.remote or options.disk or options.stack:
        assert total("remote_faults") > 0
        assert total("lookup_faults") > 0
        assert total("index_stalls") > 0
    assert (total("written_back") > 0) is options.write_back
    # the prompts saved since the last reset, read at TP 2 or 4 (seeds in turn) from the disk: found,
    # loaded and checked on every rank
    assert (total("cross_tp_blocks") > total("cross_tp_loads") > 0) is options.cross_tp
    assert {run.cross_tp_size for run in runs} == ({2, 4} if options.cross_tp else {0})
    for windowed in ("given_back", "window_loads", "saves_fenced"):
        assert (total(windowed) > 0) is bool(options.window)


def _outcome(seed: int) -> FuzzSummary | str:
    try:
        return run_fuzz(seed, 120, FuzzOptions(remote=True))
    except FuzzFailure as exc:
        return str(exc)


def test_a_seed_replays_exactly() -> None:
    assert _outcome(7) == _outcome(7)


def test_the_cli_refuses_write_back_without_a_disk(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--steps", "1", "--write-back"]) == 2
    assert "write_back: the disk tier is written back, give disk or stack too" in capsys.readouterr().err


def test_the_cli_refuses_a_read_at_another_tp_size_without_a_disk(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--steps", "1", "--cross-tp", "--remote"]) == 2
    assert "cross_tp: what the disk tier holds is read at another TP size" in capsys.readouterr().err


def test_the_cli_prints_a_summary_and_replays_failures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--steps", "40", "--seed", "4", "--no-faults"]) == 0
    out = capsys.readouterr().out
    assert "kvcore fuzz summary" in out
    assert "every check held" in out


def test_a_failed_check_exits_non_zero_with_the_replay_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing(seed: int, steps: int, options: FuzzOptions | None = None) -> FuzzSummary:
        raise FuzzFailure(
            seed, 41, "c3.t1", "loaded block 2 holds other bytes", "kvcore fuzz --seed 9", ["s41 x"]
        )

    monkeypatch.setattr("kvcore_cli.fuzz.run_fuzz", failing)
    assert main(["fuzz", "--seed", "9", "--runs", "2"]) == 1
    captured = capsys.readouterr()
    assert "check failed at step 41, seed 9 (c3.t1): loaded block 2 holds other bytes" in captured.err
    assert "replay: kvcore fuzz --seed 9" in captured.err
    assert "0 of 2 seeds passed" in captured.out
