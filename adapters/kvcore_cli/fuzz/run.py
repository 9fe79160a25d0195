"""``run_fuzz``: one seeded run. It composes kvcore's two sides as for any engine (``kvcore.plugins.compose``)
over a small model's engine KV and a small host pool, with the fuzzer's faulty ports in place of the
config's tiers, builds the model engine and the oracle over them, runs the engine and drains it, and
closes kvcore's sides."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

from kvcore.config import KVCoreConfig, load_config
from kvcore.errors import UsageError
from kvcore.model.engine import EngineSpec
from kvcore.model.head_runs import HeadRuns
from kvcore.model.layout import KVLayout, LayoutKind
from kvcore.plugins.compose import open_scheduler, open_worker
from kvcore.ports import Direction
from kvcore_cli.fuzz.checks import KVChecks
from kvcore_cli.fuzz.connector import Connector
from kvcore_cli.fuzz.cross_tp import WrittenPrompts, read_at_another_tp, reader_settings, reader_tp
from kvcore_cli.fuzz.engine import ModelEngine
from kvcore_cli.fuzz.faulty_ports import FaultyPorts
from kvcore_cli.fuzz.memory import EngineMemory
from kvcore_cli.fuzz.options import FuzzOptions
from kvcore_cli.fuzz.oracle import Bytes, KVOracle
from kvcore_cli.fuzz.requests import BLOCK_TOKENS, RequestBook
from kvcore_cli.fuzz.results import FuzzSummary
from kvcore_cli.fuzz.trace import Clock, Trace
from kvcore_cpu.tier import CPUWorker

__all__ = ["run_fuzz"]

CHUNK_TOKENS = 12  # three blocks a chunk: loads start inside chunks the engine partly holds
LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 4
HASH_IDENTITY = "kvcore-fuzz/sha256-block-chain"
LOOKUP_TIMEOUT_S = 86_400.0  # lookups end by steps, never by the machine's speed


def run_fuzz(seed: int, steps: int, options: FuzzOptions | None = None) -> FuzzSummary:
    """Run ``steps`` engine steps from ``seed``, then drain; ``FuzzFailure`` on the first failed check."""
    options = options or FuzzOptions()
    rng = random.Random(f"kvcore-fuzz:{seed}:engine")
    summary = FuzzSummary(seed=seed)
    clock = Clock()
    trace = Trace(seed, steps, options, clock)
    spec = _spec(options.engine_blocks, options.window)
    storage = torch.zeros(
        (LAYERS, options.engine_blocks, KV_HEADS, BLOCK_TOKENS, 2 * HEAD_SIZE), dtype=torch.bfloat16
    )
    # [layer, block, head, token slot, K and V bytes]: a block's bytes, slot by slot
    kv: Bytes = storage.view(torch.uint8).numpy()
    slot_bytes = CHUNK_TOKENS // BLOCK_TOKENS * spec.host_block_bytes
    config = _config(options, slot_bytes)
    oracle = KVOracle(kv[:, 0].shape)
    host: list[Bytes] = []  # the host pool's bytes, once the rank is open

    def spoil(direction: Direction, block: int, why: str) -> None:
        oracle.scribble(kv[:, block] if direction is Direction.LOAD else host[0][block], why)

    workdir = tempfile.TemporaryDirectory(prefix="kvcore-fuzz-") if options.disk or options.stack else None
    folder = Path(workdir.name) if workdir else None
    ports = FaultyPorts(seed, options, clock, spoil, slot_bytes, folder, HeadRuns.of(spec))
    # kvcore composed as for any engine, over the fuzzer's ports instead of the config's backends
    sched = open_scheduler(
        config,
        spec,
        hash_identity=HASH_IDENTITY,
        index=ports.index,
        write_back=options.write_back,
        per_head=ports.per_head,
        threaded_lookups=False,  # lookups advance by steps, never by the machine's speed
    )
    worker = open_worker(
        config, spec, list(storage.unbind(0)), remote=ports.open_remote, mover=ports.wrap_mover
    )
    if not isinstance(worker, CPUWorker) or worker.host is None or ports.mover is None:
        raise UsageError("the fuzzer's rank opened without a host pool")
    host_kv: Bytes = worker.host.blocks.numpy().reshape(-1, LAYERS, *kv.shape[2:])
    host.append(host_kv)
    memory = EngineMemory(kv, oracle)
    book = RequestBook()
    checks = KVChecks(memory, oracle, book, host_kv, trace)
    connector = Connector(
        sched,
        worker,
        ports,
        memory,
        book,
        checks,
        trace,
        summary,
        rng,
        options.recompute_late,
        options.window,
    )
    written = WrittenPrompts(lambda: sched.keyer.keyspace.namespace.epoch) if options.cross_tp else None
    if written is not None:
        connector.on_save = written.note
    engine = ModelEngine(rng, clock, options, memory, book, connector, ports, trace, summary)
    try:
        try:
            engine.run(steps)
        finally:
            ports.resume()
            sched.close()
            worker.close()
            ports.close()
        if written is not None and folder is not None:  # kvcore closed: what it wrote back is on the disk
            settings = reader_settings(
                folder, ports.disk_bytes, CHUNK_TOKENS, options.tails, slot_bytes, written.key_epoch
            )
            tp = reader_tp(seed)
            summary.cross_tp_size = tp
            read_at_another_tp(written, spec, settings, oracle, summary, trace, HASH_IDENTITY, tp)
    finally:
        if workdir is not None:
            workdir.cleanup()
    summary.steps = steps
    ports.count(summary)
    summary.evictions = sched.stats().pool.evictions
    summary.written_back = sched.stats().written_back_chunks
    return summary


def _spec(engine_blocks: int, window: int) -> EngineSpec:
    layout = KVLayout(
        kind=LayoutKind.VLLM_CPU,
        num_blocks=engine_blocks,
        block_tokens=BLOCK_TOKENS,
        num_kv_heads=KV_HEADS,
        head_size=HEAD_SIZE,
        dtype_size=2,
    )
    return EngineSpec(
        model_id="kvcore-fuzz",
        kv_dtype="bfloat16",
        num_layers=LAYERS,
        total_kv_heads=KV_HEADS,
        layout=layout,
        window_tokens=window * BLOCK_TOKENS or None,
    )


def _config(options: FuzzOptions, slot_bytes: int) -> KVCoreConfig:
    return load_config(
        {
            "backend": {"kind": "cpu", "size": options.pool_slots * slot_bytes},
            "chunk_tokens": CHUNK_TOKENS,
            "lookup_timeout_s": LOOKUP_TIMEOUT_S,
            "partial_chunks": "keep" if options.tails else "drop",
        }
    )
