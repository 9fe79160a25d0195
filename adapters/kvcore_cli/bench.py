"""``kvcore bench``: runs the benchmarks of a source checkout (they are not shipped in the wheel)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

__all__ = ["BENCHMARKS", "run_benchmarks"]

BENCHMARKS = {
    "hashing": "benchmarks.bench_hashing",
    "pool": "benchmarks.bench_pool",
    "copy": "benchmarks.bench_copy",
    "plan": "benchmarks.bench_plan",
    "ttft": "benchmarks.bench_ttft",
    "mooncake-store": "benchmarks.bench_mooncake_store",
    "pd-transfer": "benchmarks.bench_pd_transfer",
    "lmcache": "benchmarks.bench_lmcache",
    "disk": "benchmarks.bench_disk",
}


def run_benchmarks(names: Sequence[str], quick: bool = False) -> int:
    """Run the named benchmarks (all by default); returns a process exit code."""
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}", file=sys.stderr)
        return 2
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "benchmarks").is_dir():
        print("kvcore bench runs from a source checkout (benchmarks/ is not installed)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(checkout))
    code = 0
    for name in names or list(BENCHMARKS):
        print(f"\n## {name}", flush=True)
        module = importlib.import_module(BENCHMARKS[name])
        bench_main = cast(Callable[[list[str] | None], int], module.main)
        code = max(code, bench_main(["--quick"] if quick else []))
    return code
