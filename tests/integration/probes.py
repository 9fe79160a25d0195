"""Out-of-band checks on real engines: metrics read in the test process, and functions that run inside
an engine's worker process (through ``LLM.collective_rpc``) to read kvcore's tier there."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

from kvcore.testing.faults import TransferDelays
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.tier import CPUWorker
from kvcore_vllm.grouped_worker import GroupedWorkerSide
from kvcore_vllm.pd_tiers_worker import PDTiersWorker
from kvcore_vllm.pd_worker import PDWorker
from kvcore_vllm.worker_side import WorkerSide

__all__ = [
    "SLOW_COPIES",
    "damage_pool",
    "die_mid_write",
    "disk_chunk_values",
    "engine_digests",
    "engine_metrics",
    "external_hits",
    "group_loads",
    "group_sides",
    "host_digests",
    "kvcore_metric",
    "loaded_digests",
    "pulled_blocks",
    "rank_pool",
    "shorten_pd_patience",
    "worker_side",
]


SLOW_COPIES = TransferDelays()
"""In an engine's process: the fault hooks of the ranks of an engine configured with
``"faults": "tests.integration.probes:SLOW_COPIES"`` (``kvcore_vllm.settings``; the shared
``kvcore_engine``); a function run through ``collective_rpc`` slows or restores its copies."""


def disk_chunk_values(root: Path, runs: int) -> dict[str, bytes]:
    """In the test process: each chunk's value in a disk tier's folder as a TP-1 engine's host slot holds
    it, by its key less the heads. The tier keeps a file per KV head (its value: the head's run of each
    layer of each block, ``runs`` of them, in that order); the slot interleaves them, every head's run of a
    layer and block one after another."""
    from kvcore_disk.chunk_file import ChunkHeader, header_bytes

    heads: dict[str, dict[int, bytes]] = {}
    for path in (root / "chunks").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            key = ChunkHeader.unpack(data).key
            kind, namespace, shard, chunk = key.split("/")
            layers, head, *rest = shard.split(".")
            head_start = int(head[1:].split("-")[0])
            value = data[header_bytes(key) :]
            heads.setdefault("/".join([kind, namespace, ".".join([layers, *rest]), chunk]), {})[
                head_start
            ] = value
    values = {}
    for name, by_head in heads.items():
        parts = [by_head[h] for h in sorted(by_head)]
        run = len(parts[0]) // runs
        values[name] = b"".join(part[i * run : (i + 1) * run] for i in range(runs) for part in parts)
    return values


def engine_metrics(llm: Any) -> list[Any]:
    """vLLM's metrics of the engine ``llm``. vLLM keeps one registry per process, whose metrics are those
    of the engine started last (each engine's loggers replace the previous one's): reading them through
    another engine would read that one's, so this fails unless they carry ``llm``'s served model name
    (``conftest.start_engine`` gives every engine its own)."""
    name = llm.llm_engine.model_config.served_model_name
    metrics = [m for m in llm.get_metrics() if m.labels.get("model_name") == name]
    assert metrics, f"the metrics of engine {name!r} are not this process's: an engine started after it"
    return metrics


def external_hits(llm: Any) -> int:
    """vLLM's external prefix-cache hits of the engine so far (``engine_metrics``): compare deltas."""
    return sum(int(m.value) for m in engine_metrics(llm) if m.name == "vllm:external_prefix_cache_hits")


def kvcore_metric(llm: Any, name: str) -> float:
    """The value of kvcore's metric ``name`` as vLLM exports it (``vllm:kvcore_<name>``)."""
    for metric in engine_metrics(llm):
        if metric.name == f"vllm:kvcore_{name}":
            return float(metric.value)
    raise AssertionError(f"metric vllm:kvcore_{name} not exported")


def worker_side(worker: Any) -> WorkerSide:
    """In the worker process: kvcore's worker side of the engine's connector (a model of one KV-cache
    group)."""
    (side,) = group_sides(worker)
    return side


def group_sides(worker: Any) -> tuple[WorkerSide, ...]:
    """In the worker process: kvcore's worker side of each KV-cache group, in vLLM's group order."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvcore_vllm.connector import KVCoreConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, KVCoreConnector)
    side = connector.worker_side
    tiers = side.tiers if isinstance(side, PDTiersWorker) else side
    return tiers.sides if isinstance(tiers, GroupedWorkerSide) else (tiers,)


def pulled_blocks(worker: Any) -> int:
    """In the worker process: blocks this rank received whole from P/D producers so far (the P/D
    connector, or a connector with a ``pd`` section beside its tiers)."""
    return pd_worker().pulled_blocks


def die_mid_write(worker: Any) -> int:
    """In a P/D producer's worker process: its next write to a consumer writes the first half of its byte
    ranges, then the process is killed (SIGKILL): a producer that dies mid-transfer, after it accepted the
    pull, with part of the KV written (where the half write fails, the process lives on, and the test
    finds it alive). Returns the process id."""
    producer = pd_worker().producer
    assert producer is not None, "this rank produces nothing"
    transport = producer._transport  # the write to instrument is the transport's
    submit = transport.submit_write_columns

    def half_then_die(peer: str, srcs: Any, dsts: Any, lengths: Any) -> Any:
        half = len(lengths) // 2
        assert half, f"a write of {len(lengths)} ranges has no half to write"
        job = submit(peer, srcs[:half], dsts[:half], lengths[:half])
        (written,) = transport.wait([job], 10.0)
        assert written.ok, f"the half write failed: {written.error}"
        os.kill(os.getpid(), signal.SIGKILL)
        return job

    transport.submit_write_columns = half_then_die  # type: ignore[method-assign]  # the fault itself
    return os.getpid()


def shorten_pd_patience(worker: Any, seconds: float) -> bool:
    """In a P/D consumer's worker process: from the next receive on, give up on a transfer not done
    ``seconds`` after the receive started (its ``abort_timeout_s``)."""
    import attrs

    consumer = pd_worker().consumer
    assert consumer is not None, "this rank consumes nothing"
    consumer._config = attrs.evolve(consumer._config, abort_timeout_s=seconds)
    return True


def pd_worker() -> PDWorker:
    """In the worker process: the P/D side of the engine's connector (either connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvcore_vllm.connector import KVCoreConnector
    from kvcore_vllm.pd_connector import KVCorePDConnector

    connector = get_kv_transfer_group()
    if isinstance(connector, KVCorePDConnector):
        return connector.worker_side
    assert isinstance(connector, KVCoreConnector)
    side = connector.worker_side
    assert isinstance(side, PDTiersWorker), f"no P/D beside the tiers: {type(side).__name__}"
    return side.pd


def rank_worker(worker: Any) -> CPUWorker:
    """In the worker process: kvcore's worker of the rank (every backend here runs on torch's)."""
    return _tier(worker_side(worker))


def rank_pool(worker: Any) -> HostMemory:
    """In the worker process: the host pool of the rank (a backend with one)."""
    host = rank_worker(worker).host
    assert host is not None, "this backend has no host pool"
    return host


def damage_pool(worker: Any) -> bool:
    """In the worker process: overwrite every byte the rank's host pool holds (out of band)."""
    rank_pool(worker).buffer.bitwise_not_()
    return True


def host_digests(worker: Any) -> set[str]:
    """In the worker process: digests of every host block of the rank's pool."""
    tier = rank_worker(worker)
    return {hashlib.sha256(tier.host_block_bytes(b)).hexdigest() for b in range(rank_pool(worker).num_blocks)}


def engine_digests(worker: Any) -> set[str]:
    """In the worker process: digests of every engine block of the rank (what a tier can have saved)."""
    tier = rank_worker(worker)
    return {hashlib.sha256(tier.engine_block_bytes(b)).hexdigest() for b in range(tier.engine_kv.num_blocks)}


def loaded_digests(worker: Any) -> tuple[list[str], bool]:
    """In the worker process: digests of the last loaded engine blocks, and whether they hold exactly the
    host bytes they were loaded from (with no host pool, the tier moved them itself: true)."""
    return _last_load(worker_side(worker))


def group_loads(worker: Any) -> list[tuple[list[str], bool, int]]:
    """In the worker process, for each KV-cache group: ``loaded_digests`` of its last load, and the bytes
    of one engine block of the group (every layer of it)."""
    return [(*_last_load(side), _tier(side).engine_kv.host_block_bytes) for side in group_sides(worker)]


def _last_load(side: WorkerSide) -> tuple[list[str], bool]:
    engine_blocks, host_blocks = side.last_load
    tier = _tier(side)
    same = not host_blocks or all(
        tier.engine_block_bytes(e) == tier.host_block_bytes(h)
        for e, h in zip(engine_blocks, host_blocks, strict=True)
    )
    return [hashlib.sha256(tier.engine_block_bytes(e)).hexdigest() for e in engine_blocks], same


def _tier(side: WorkerSide) -> CPUWorker:
    tier = side.worker
    assert isinstance(tier, CPUWorker), tier
    return tier
