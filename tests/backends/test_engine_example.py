"""The documented example for engines that are not vLLM runs and round-trips its KV."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "toy_engine.py"


def test_toy_engine_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "loaded 256 of 300 tokens from kvcore; bytes identical: True" in out.stdout
