"""``kvcore`` console script: parses the command line and hands off to one verb."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvcore.config import config_to_dict, load_config_file
from kvcore.errors import KVCoreError

__all__ = ["main"]


def _config_check(args: argparse.Namespace) -> int:
    try:
        config = load_config_file(args.file)
    except KVCoreError as exc:
        print(f"invalid config {args.file}: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):
            print(f"  {note}", file=sys.stderr)
        return 2
    print(json.dumps(config_to_dict(config), indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvcore_cli.demo import DemoOptions, run_demo

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
    summary = run_demo(options)
    print(summary.render())
    return 0 if summary.verified_ok else 1


def _vllm_config(args: argparse.Namespace) -> int:
    from kvcore_vllm.settings import transfer_config

    try:
        config = transfer_config(backend=args.backend, size=args.size, role=args.role, endpoint=args.endpoint)
    except KVCoreError as exc:
        print(f"kvcore vllm-config: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(config))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvcore_cli.bench import run_benchmarks

    return run_benchmarks(args.names, quick=args.quick)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcore", description="Move and reuse LLM KV cache.")
    verbs = parser.add_subparsers(dest="verb", required=True)

    demo = verbs.add_parser("demo", help="run a multi-chat workload on the embedded CPU backend")
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
    demo.set_defaults(run=_demo)

    bench = verbs.add_parser("bench", help="run the benchmarks and print ratios (from a source checkout)")
    bench.add_argument("names", nargs="*", help="hashing, pool, copy, plan (default: all)")
    bench.add_argument("--quick", action="store_true", help="a few seconds each")
    bench.set_defaults(run=_bench)

    vllm = verbs.add_parser("vllm-config", help="print the --kv-transfer-config JSON for vLLM")
    vllm.add_argument("--backend", default="cpu", help="cpu (default), mooncake or lmcache")
    vllm.add_argument(
        "--size",
        default=None,
        help="host pool, total across ranks (default 8GiB; lmcache: none, blocks go straight to the server)",
    )
    vllm.add_argument(
        "--endpoint", help="Mooncake master (127.0.0.1:50051) or LMCache URL (tcp://localhost:5555)"
    )
    vllm.add_argument("--role", default="kv_both", choices=("kv_both", "kv_producer", "kv_consumer"))
    vllm.set_defaults(run=_vllm_config)

    config = verbs.add_parser("config", help="configuration tools")
    config_verbs = config.add_subparsers(dest="config_verb", required=True)
    check = config_verbs.add_parser("check", help="validate a JSON config; print resolved values or errors")
    check.add_argument("file")
    check.set_defaults(run=_config_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
