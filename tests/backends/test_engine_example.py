"""The documented example for engines that are not vLLM runs and round-trips its KV (the CPU tier and the
disk tier; the Mooncake store and the LMCache server run it in their own folders, next to a real master
and server)."""

from __future__ import annotations

from pathlib import Path

from tests.engine_example import run_toy_engine


def test_toy_engine_example_runs_on_the_cpu_tier() -> None:
    out = run_toy_engine()
    assert "cpu: loaded 288 of 300 tokens from kvcore; bytes identical: True" in out
    assert "earlier run" not in out


def test_toy_engine_example_runs_twice_on_one_disk_directory(tmp_path: Path) -> None:
    # the second run's first request finds the first run's chunk files and loads them instead of computing
    backend = {"kind": "disk", "path": str(tmp_path), "size": "256MiB", "local_size": "64MiB"}
    first = run_toy_engine(backend)
    assert "earlier run" not in first
    assert "disk: loaded 288 of 300 tokens from kvcore; bytes identical: True" in first
    second = run_toy_engine(backend)
    found = "disk: found 288 of 300 tokens saved by an earlier run; loaded instead of computed"
    assert f"{found}; bytes identical: True" in second
    assert "disk: loaded 288 of 300 tokens from kvcore; bytes identical: True" in second
