"""``kvcore bench serve``'s Mooncake configuration, as a user runs it: a fresh ``mooncake_master`` and a
segment holder started by the benchmark, kvcore's CPU tier of vLLM's cache size in front of the store, a
served engine under streaming clients. The burst workload: the prefix loaded once per round, no request
failed, no answer unlike vLLM alone's. (Inside the tests' loopback-only namespace the benchmark does not
re-execute itself.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import VLLM_MARKS

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(600)]

CHECKOUT = Path(__file__).resolve().parents[2]
PREFIX_TOKENS = 512  # --quick's
ROUNDS = 2  # --quick's --turns: burst rounds


def test_the_serving_benchmark_runs_kvcore_on_a_mooncake_store_it_starts(tmp_path: Path) -> None:
    figures = tmp_path / "serve.json"
    argv = ["kvcore_cli.main", "bench", "serve", "--quick", "--"]
    flags = ["--configs", "vllm,kvcore-mooncake", "--workloads", "burst", "--json", str(figures)]
    done = subprocess.run(
        [sys.executable, "-m", *argv, *flags],
        check=False,
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["config"]: row for row in json.loads(figures.read_text())["rows"]}
    assert set(rows) == {"vllm", "kvcore-mooncake"}
    mine = rows["kvcore-mooncake"]
    assert mine["errors"] == 0
    assert mine["differ"] == 0
    assert mine["ext"] == ROUNDS * PREFIX_TOKENS  # one load per round
    assert rows["vllm"]["ext"] == 0
