"""The core is framework-free: importing kvcore must not drag in any engine, tensor or network library."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("torch", "numpy", "zmq", "vllm", "mooncake", "lmcache", "pytest", "hypothesis")


def test_importing_kvcore_loads_no_framework() -> None:
    # a fresh interpreter: whatever this test process already imported must not hide a leak
    code = "import json, sys, kvcore; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded = json.loads(out)
    leaked = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)
    assert leaked == []
    assert "kvcore" in loaded
