"""The documented example for engines that are not vLLM runs and round-trips its KV (the CPU tier; the
Mooncake store and the LMCache server run it in their own folders, next to a real master and server)."""

from __future__ import annotations

from tests.engine_example import run_toy_engine


def test_toy_engine_example_runs_on_the_cpu_tier() -> None:
    assert "cpu: loaded 288 of 300 tokens from kvcore; bytes identical: True" in run_toy_engine()
