"""The cross-TP cost count (``benchmarks.bench_cross_tp``): its table holds what the plans say."""

from __future__ import annotations

import pytest

from benchmarks.bench_cross_tp import main


def _rows(out: str) -> dict[tuple[str, str, str], list[str]]:
    rows = {}
    for line in out.splitlines():
        for design in ("today", "per head", "writer shards"):
            if line.startswith(design):
                cells = line[len(design) :].split()
                rows[design, cells[0], cells[1]] = cells[2:]
    return rows


def test_per_head_reads_exactly_and_writer_shards_read_what_a_larger_shard_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--heads", "8", "--layers", "4", "--quick"]) == 0
    rows = _rows(capsys.readouterr().out)
    designs = ("today", "per head", "writer shards")
    assert {(d, b) for d, _, b in rows} == {(d, b) for d in designs for b in "12"}
    values, read, copies, size, keys = rows["per head", "any", "2"]
    assert (values, read, keys) == ("4", "1.00x", "8")  # a TP 2 rank holds 4 of 8 heads: fetched exactly
    assert rows["writer shards", "1", "2"][:2] == ["1", "2.00x"]  # the TP 1 shard holds twice its heads
    assert rows["writer shards", "8", "1"][:2] == ["8", "1.00x"]  # eight shards make one rank's heads
    assert rows["writer shards", "1", "1"][4] == str(1 + 2 + 4 + 8)  # the writer's TP size is unknown
    assert rows["today", "2", "2"][:2] == ["1", "1.00x"]
    # per head, a rank's copies are its heads' runs: as many bytes as today's, in pieces a head long
    today = rows["today", "2", "2"]
    assert int(copies) * float(size) == pytest.approx(int(today[2]) * float(today[3]))
