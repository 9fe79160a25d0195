"""``kvcore bench serve --quick``, as a user runs it: real servers, streaming clients, the table printed.

Three workloads of the quick run (the tiny model, vLLM alone and kvcore's CPU tier, each one server for
the three, vLLM's prefix cache reset between them: a workload must not see another's): unique prompts,
the burst, where every user asks at once on a prefix that only kvcore still holds — one load per round,
the others served from vLLM's own cache once it is there — and the stall, streams decoding while stored
long prompts come back, each loaded whole. No request fails and no answer differs from vLLM alone's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serve_load import STALL_LOADS, STALL_LONG
from tests.integration.conftest import VLLM_MARKS
from tests.integration.served import quick_serve_rows

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(900)]

PREFIX_TOKENS = 512  # --quick's
ROUNDS = 2  # --quick's --turns: burst rounds


def test_the_quick_serving_benchmark_runs_and_prints_its_table(tmp_path: Path) -> None:
    rows = quick_serve_rows(tmp_path, ["--workloads", "unique,burst,stall"], timeout_s=840)
    assert set(rows) == {(w, c) for w in ("unique", "burst", "stall") for c in ("vllm", "kvcore-cpu")}
    for row in rows.values():
        assert row["errors"] == 0
        assert row["differ"] == 0
        assert row["throughput"] > 0
        assert row["ttft_p99"] >= row["ttft_p50"] > 0
    assert (
        rows["unique", "kvcore-cpu"]["ext"] == rows["unique", "kvcore-cpu"]["local"] == 0
    )  # nothing to reuse
    assert rows["burst", "vllm"]["ext"] == 0
    assert rows["burst", "kvcore-cpu"]["ext"] == ROUNDS * PREFIX_TOKENS  # one load per round
    assert rows["burst", "kvcore-cpu"]["local"] > 0  # the others: vLLM's own cache, once loaded
    # each stored long prompt comes back whole but its last token (vLLM computes one), after vLLM's reset
    assert rows["stall", "kvcore-cpu"]["ext"] == STALL_LOADS * (STALL_LONG * PREFIX_TOKENS - 1)
    assert rows["stall", "vllm"]["ext"] == rows["stall", "vllm"]["local"] == 0
