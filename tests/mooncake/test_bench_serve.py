"""``kvcore bench serve``'s Mooncake configuration, as a user runs it: a fresh ``mooncake_master`` and a
segment holder started by the benchmark, kvcore's CPU tier of vLLM's cache size in front of the store, a
served engine under streaming clients. The burst workload: the prefix loaded once per round, no request
failed, no answer unlike vLLM alone's. (Inside the tests' loopback-only namespace the benchmark does not
re-execute itself.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import VLLM_MARKS
from tests.integration.served import quick_serve_rows

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(600)]

PREFIX_TOKENS = 512  # --quick's
ROUNDS = 2  # --quick's --turns: burst rounds


def test_the_serving_benchmark_runs_kvcore_on_a_mooncake_store_it_starts(tmp_path: Path) -> None:
    # a server per workload, as without --quick (one workload: as many servers as --one-server starts)
    flags = ["--configs", "vllm,kvcore-mooncake", "--workloads", "burst", "--no-one-server"]
    rows = {config: row for (_, config), row in quick_serve_rows(tmp_path, flags, timeout_s=540).items()}
    assert set(rows) == {"vllm", "kvcore-mooncake"}
    mine = rows["kvcore-mooncake"]
    assert mine["errors"] == 0
    assert mine["differ"] == 0
    assert mine["ext"] == ROUNDS * PREFIX_TOKENS  # one load per round
    assert rows["vllm"]["ext"] == 0
