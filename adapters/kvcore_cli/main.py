"""``kvcore`` console script: parses the command line and hands off to one verb."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcore.errors import KVCoreError
from kvcore.plugins.preflight import EngineFlags

__all__ = ["main"]


def _doctor(args: argparse.Namespace) -> int:
    from kvcore_cli.doctor import run, vllm_bytes

    try:
        cache = (
            None
            if args.kv_cache_memory_bytes is None
            else vllm_bytes(args.kv_cache_memory_bytes, "--kv-cache-memory-bytes")
        )
    except KVCoreError as exc:
        print(f"kvcore doctor: {exc}", file=sys.stderr)
        return 2
    flags = EngineFlags(
        model=args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        cache_bytes=cache,
        memory_share=args.gpu_memory_utilization,
        timeout_s=args.timeout,
    )
    engine = any(v is not None for v in (args.model, args.kv_cache_memory_bytes, args.gpu_memory_utilization))
    return run(args.config, flags, engine=engine, strict=args.strict, as_json=args.json)


def _add_doctor(verbs: Any, name: str, help_text: str) -> None:
    doctor = verbs.add_parser(name, help=help_text, description=help_text)
    doctor.add_argument(
        "config",
        help="vLLM's --kv-transfer-config JSON, kvcore's config alone, or a .json/.yaml file of either",
    )
    doctor.add_argument("--model", help="vLLM's --model: the model's shape sizes one chunk (needs vLLM)")
    doctor.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's --tensor-parallel-size")
    doctor.add_argument(
        "--kv-cache-memory-bytes",
        help="vLLM's own KV cache, as vLLM reads it: 256M is 256 MiB (on CPU: host memory)",
    )
    doctor.add_argument(
        "--gpu-memory-utilization", type=float, help="vLLM's share of memory (on CPU: of host memory)"
    )
    doctor.add_argument("--timeout", type=float, default=2.0, help="seconds each server may take to answer")
    doctor.add_argument("--strict", action="store_true", help="exit 1 on a warning too")
    doctor.add_argument("--json", action="store_true", help="the findings as JSON")
    doctor.set_defaults(run=_doctor)


def _tiny_model(args: argparse.Namespace) -> int:
    from kvcore_cli.tiny_model import MAKERS

    path = MAKERS[args.kind](args.out_dir, args.seed)
    print(f"a tiny {args.kind} model (random weights) written to {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvcore_cli.demo import DemoOptions, DemoWorkload, run_demo, write_json

    options = DemoOptions(
        chats=args.chats,
        turns=args.turns,
        seed=args.seed,
        duration_s=args.duration,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        block_tokens=args.block_tokens,
        chunk_tokens=args.chunk_tokens,
        engine_size=args.engine_size,
        pool_size=args.pool_size,
        progress=not args.no_progress,
    )
    try:
        if args.plot:
            from kvcore_cli.demo_plot import figure_class, plot_demo

            figure_class()  # before the run: a missing matplotlib fails at once
        workload = DemoWorkload.build(options)
        print(workload.render(), flush=True)
        summary = run_demo(workload)
    except KVCoreError as exc:
        print(f"kvcore demo: {exc}", file=sys.stderr)
        return 2
    print(summary.render())
    try:
        if args.json:
            write_json(summary, args.json)
            print(f"\nfigures written to {args.json}")
        if args.plot:
            plot_demo(summary, args.plot)
            print(f"picture drawn in {args.plot}")
    except OSError as exc:
        print(f"kvcore demo: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0 if summary.verified_ok else 1


def _vllm_config(args: argparse.Namespace) -> int:
    from kvcore_cli.vllm_config import transfer_config

    try:
        config = transfer_config(
            backend=args.backend,
            size=args.size,
            role=args.role,
            endpoint=args.endpoint,
            disk=args.disk,
            disk_size=args.disk_size,
            disk_write=args.disk_write,
        )
    except KVCoreError as exc:
        print(f"kvcore vllm-config: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(config))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvcore_cli.bench import listing, run_benchmarks

    if args.list:
        print(listing())
        return 0
    return run_benchmarks(args.names, quick=args.quick, verbose=args.verbose, extra=args.extra)


def _fuzz(args: argparse.Namespace) -> int:
    import logging

    logger = logging.getLogger("kvcore")
    level = logger.level
    if not args.verbose:  # the faults are injected on purpose: kvcore's warnings about them are expected
        logger.setLevel(logging.ERROR)
    try:
        return _fuzz_runs(args)
    finally:
        logger.setLevel(level)  # as it was: a caller that runs the CLI in its process keeps its logging


_NOT_WITH_PD = (
    "remote",
    "disk",
    "stack",
    "write_back",
    "cross_tp",
    "no_reset",
    "no_tails",
    "hold_late_loads",
)
"""``kvcore fuzz`` flags of the core's fuzz that ``--pd`` (the vLLM adapter's) has no use for."""


def _pd_fuzz_runs(args: argparse.Namespace) -> int:
    """``kvcore fuzz --pd``: ``kvcore_vllm.pd_fuzz`` in a process of its own (adapters import no other
    adapter), or 2 where flags only the core's fuzz takes are given or vLLM is not installed."""
    import importlib.util
    import subprocess

    from kvcore_cli.fuzz import FuzzOptions

    default = FuzzOptions()
    given = [name for name in _NOT_WITH_PD if getattr(args, name)]
    given += [
        name
        for name in ("engine_blocks", "pool_slots", "trace")
        if getattr(args, name) != getattr(default, name)
    ]
    if given:
        flags = " ".join(f"--{name.replace('_', '-')}" for name in given)
        print(f"kvcore fuzz: --pd: got {flags}, which only the core's fuzz takes", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("kvcore_vllm") is None:
        print("kvcore fuzz: --pd drives kvcore's vLLM adapter, which needs vLLM installed", file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", "kvcore_vllm.pd_fuzz", "--seed", str(args.seed), "--steps", str(args.steps)]
    argv += ["--runs", str(args.runs), "--window", str(args.window)]
    argv += (
        ["--no-preempt"] * args.no_preempt + ["--no-faults"] * args.no_faults + ["--verbose"] * args.verbose
    )
    return subprocess.run(argv, check=False).returncode


def _fuzz_runs(args: argparse.Namespace) -> int:
    from kvcore_cli.fuzz import FuzzFailure, FuzzOptions, run_fuzz

    if args.pd:
        return _pd_fuzz_runs(args)
    try:
        options = FuzzOptions(
            remote=args.remote,
            disk=args.disk,
            stack=args.stack,
            write_back=args.write_back,
            preempt=not args.no_preempt,
            reset=not args.no_reset,
            faults=not args.no_faults,
            recompute_late=not args.hold_late_loads,
            tails=not args.no_tails,
            engine_blocks=args.engine_blocks,
            pool_slots=args.pool_slots,
            window=args.window,
            cross_tp=args.cross_tp,
            trace=args.trace,
        )
    except KVCoreError as exc:
        print(f"kvcore fuzz: {exc}", file=sys.stderr)
        return 2
    failed = 0
    for seed in range(args.seed, args.seed + args.runs):
        try:
            summary = run_fuzz(seed, args.steps, options)
        except FuzzFailure as exc:
            print(exc, file=sys.stderr)
            failed += 1
            continue
        print(summary.render() if args.runs == 1 else summary.brief())
    if args.runs > 1:
        print(f"{args.runs - failed} of {args.runs} seeds passed")
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcore", description="Move and reuse LLM KV cache.")
    parser.add_argument(
        "--version", action=_Versions, help="kvcore's version, and those of the engines and clients found"
    )
    verbs = parser.add_subparsers(dest="verb", required=True)

    demo = verbs.add_parser(
        "demo", help="run a multi-chat workload on the embedded CPU backend; compare it without kvcore"
    )
    demo.add_argument("--chats", type=int, default=24, help="concurrent conversations (default 24)")
    demo.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--duration", type=float, default=45.0, help="stop after this many seconds")
    demo.add_argument("--layers", type=int, default=32)
    demo.add_argument("--kv-heads", type=int, default=8)
    demo.add_argument("--head-size", type=int, default=128)
    demo.add_argument("--block-tokens", type=int, default=16)
    demo.add_argument("--chunk-tokens", type=int, default=256)
    demo.add_argument("--engine-size", default="1GiB", help="engine KV memory (default 1GiB)")
    demo.add_argument("--pool-size", default="3GiB", help="kvcore host pool (default 3GiB)")
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument("--json", metavar="FILE", help="write the workload and every figure to FILE as JSON")
    demo.add_argument(
        "--plot", metavar="FILE.png", help="draw tokens per turn and the pool over time (needs matplotlib)"
    )
    demo.set_defaults(run=_demo)

    from kvcore_cli.bench import BENCHMARKS, listing

    bench = verbs.add_parser(
        "bench",
        help="run the benchmarks and print ratios against their baselines (from a source checkout)",
        epilog=f"benchmarks:\n{listing()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "names",
        nargs="*",
        help=f"{', '.join(BENCHMARKS)} (default: all but serve); after --, one benchmark's own flags",
    )
    bench.add_argument("--quick", action="store_true", help="a few seconds each (plus any engine's start)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks, their baselines and legends")
    bench.add_argument(
        "--verbose", action="store_true", help="show Mooncake's, LMCache's and vLLM's own log lines"
    )
    bench.set_defaults(run=_bench)

    fuzz = verbs.add_parser(
        "fuzz", help="drive the scheduler and the CPU worker with a seeded engine; check every block"
    )
    fuzz.add_argument("--steps", type=int, default=300, help="engine steps per run (default 300)")
    fuzz.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    fuzz.add_argument("--runs", type=int, default=1, help="seeds to run, from --seed on (default 1)")
    fuzz.add_argument("--remote", action="store_true", help="a remote tier (in-memory store) behind the pool")
    fuzz.add_argument(
        "--disk", action="store_true", help="the disk tier (files in a temporary directory) instead"
    )
    fuzz.add_argument(
        "--stack", action="store_true", help="a cascade: the disk tier, then an in-memory store"
    )
    fuzz.add_argument(
        "--write-back", action="store_true", help="with --disk or --stack: the disk tier written back"
    )
    fuzz.add_argument(
        "--cross-tp",
        action="store_true",
        help="with --disk or --stack: after the run, read what the disk tier holds at TP 2 or 4 (seeds in "
        "turn) and check it",
    )
    fuzz.add_argument("--no-preempt", action="store_true", help="no random preemptions")
    fuzz.add_argument("--no-reset", action="store_true", help="no resets")
    fuzz.add_argument("--no-faults", action="store_true", help="no failing, late or stalling jobs")
    fuzz.add_argument("--no-tails", action="store_true", help="partial_chunks drop: full chunks only")
    fuzz.add_argument(
        "--hold-late-loads", action="store_true", help="hold a request until its late load is reported"
    )
    fuzz.add_argument("--engine-blocks", type=int, default=40, help="engine KV blocks (default 40)")
    fuzz.add_argument("--pool-slots", type=int, default=16, help="host pool, in chunks (default 16)")
    fuzz.add_argument(
        "--window", type=int, default=0, help="a sliding-window model, of this many blocks (default 0: none)"
    )
    fuzz.add_argument("--trace", type=int, default=40, help="API calls shown with a failure (default 40)")
    fuzz.add_argument(
        "--pd",
        action="store_true",
        help="instead: P/D beside the tiers, kvcore's vLLM connector sides under a model of vLLM's "
        "scheduler (kvcore_vllm.pd_fuzz, needs vLLM); with --window N a hybrid model (a sliding window of "
        "N blocks); takes --seed, --steps, --runs, --no-preempt, --no-faults",
    )
    fuzz.add_argument("--verbose", action="store_true", help="show kvcore's warnings")
    fuzz.set_defaults(run=_fuzz)

    vllm = verbs.add_parser("vllm-config", help="print the --kv-transfer-config JSON for vLLM")
    vllm.add_argument(
        "--backend", default="cpu", help="the first tier's kind: cpu (default), mooncake_store or lmcache_mp"
    )
    vllm.add_argument(
        "--size",
        default=None,
        help="host pool, total across ranks (default 8GiB; lmcache: none, blocks go straight to the server)",
    )
    vllm.add_argument(
        "--endpoint", help="Mooncake master (127.0.0.1:50051) or LMCache URL (tcp://localhost:5555)"
    )
    vllm.add_argument("--role", default="kv_both", choices=("kv_both", "kv_producer", "kv_consumer"))
    vllm.add_argument("--disk", help="a directory for a disk tier behind the host pool (with --disk-size)")
    vllm.add_argument("--disk-size", help="bytes of chunk files the disk tier may hold, e.g. 1TiB")
    vllm.add_argument(
        "--disk-write",
        help="with --disk: through (default: each save reaches the disk) or back (when the pool evicts it)",
    )
    vllm.set_defaults(run=_vllm_config)

    tiny = verbs.add_parser(
        "tiny-model",
        help="write a tiny random-weight model (and its tokenizer) that vLLM's CPU build loads in seconds",
    )
    tiny.add_argument("out_dir", type=Path, help="the folder to write it to (made if missing)")
    tiny.add_argument(
        "--kind",
        default="llama",
        choices=("llama", "mla", "hybrid", "two-block", "ssm"),
        help="(default: llama)",
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_tiny_model)

    doctor_help = "check a config as the engine will before it starts (paths, servers, memory), as a table"
    _add_doctor(verbs, "doctor", doctor_help)
    config = verbs.add_parser("config", help="configuration tools")
    _add_doctor(
        config.add_subparsers(dest="config_verb", required=True), "check", "the same as kvcore doctor"
    )
    return parser


class _Versions(argparse.Action):
    """``--version``: print the versions found and exit (argparse's own takes a fixed string)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from kvcore_cli.doctor import versions

        print(versions())
        parser.exit()


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    # after `--`, one benchmark's own flags: `kvcore bench serve -- --clients 4`
    cut = given.index("--") if "--" in given else len(given)
    parser = _parser()
    args = parser.parse_args(given[:cut])
    args.extra = given[cut + 1 :]
    if args.extra and args.run is not _bench:
        parser.error(f"flags after --: {' '.join(args.extra)}; only `kvcore bench NAME -- ...` takes them")
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
