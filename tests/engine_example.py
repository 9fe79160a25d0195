"""Runs docs/examples/toy_engine.py as a user would, with the backend section given on its command line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "toy_engine.py"


def run_toy_engine(backend: Mapping[str, object] | None = None) -> str:
    """The example's output; fails the test when it exits with an error."""
    argv = [sys.executable, str(EXAMPLE), *([json.dumps(backend)] if backend is not None else [])]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout
