"""A toy engine that is not vLLM, using kvcore's engine-agnostic API with any installed backend.

Run it: ``python docs/examples/toy_engine.py`` (the embedded CPU tier), or give the ``backend`` section
of a config as JSON: ``python docs/examples/toy_engine.py '{"kind": "lmcache_mp", "url":
"tcp://127.0.0.1:5555"}'``. It serves a prompt, saves its KV, forgets it, serves the same prompt again
in other blocks and loads the KV back instead of recomputing it, then checks the bytes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping

import torch

from kvcore import (
    CacheScheduler,
    EngineSpec,
    HeadOrder,
    KVLayout,
    LayoutKind,
    RequestId,
    load_config,
    open_scheduler,
    open_worker,
)

BLOCK = 16  # tokens per engine block
LAYERS = 4
CPU_TIER = {"kind": "cpu", "size": "256MiB"}


def lookup(scheduler: CacheScheduler, request: RequestId, prompt: list[int]) -> int:
    """The tokens kvcore can load; a remote tier may answer a step later (``None``: ask again)."""
    deadline = time.monotonic() + 10.0
    while (hits := scheduler.lookup(request, tokens=prompt)) is None:
        if time.monotonic() > deadline:
            return 0
        time.sleep(0.01)
    return hits


def main(backend: Mapping[str, object]) -> int:
    # 1. Describe the engine: its KV layout per layer (FlashInfer's [blocks, 2, block, heads, head], NHD).
    layout = KVLayout(
        kind=LayoutKind.FLASH_INFER,
        num_blocks=128,
        block_tokens=BLOCK,
        num_kv_heads=4,
        head_size=64,
        dtype_size=2,
        head_order=HeadOrder.NHD,
    )
    engine = EngineSpec(
        model_id="toy-4L", kv_dtype="bfloat16", num_layers=LAYERS, total_kv_heads=4, layout=layout
    )
    kv = [torch.zeros(layout.shape, dtype=torch.bfloat16) for _ in range(LAYERS)]

    # 2. Build both sides through the one composition call, whatever the backend: the scheduler
    #    decides, the worker (one per rank) copies.
    config = load_config({"backend": backend, "chunk_tokens": 128})
    scheduler = open_scheduler(config, engine)
    worker = open_worker(config, engine, kv)

    def run_step() -> None:
        plan = scheduler.take_plan()
        worker.execute(plan)
        scheduler.complete(worker.wait(plan.op_ids(), timeout=10.0))

    prompt = list(range(1000, 1300))  # 300 tokens
    blocks_a = list(range(19))
    try:
        # 3. First request: nothing cached. "Compute" its KV, then save its full chunks (and, with a
        #    local pool, the tail: the two whole blocks of its third chunk).
        first = RequestId("first")
        assert lookup(scheduler, first, prompt) == 0
        for layer in kv:
            layer[blocks_a] = torch.randn(len(blocks_a), *layout.shape[1:]).to(torch.bfloat16)
        scheduler.save(first, blocks_a, num_tokens=len(prompt))
        run_step()
        scheduler.finish(first)

        # 4. Same prompt again, in other blocks: kvcore loads the cached prefix.
        second = RequestId("second")
        cached = lookup(scheduler, second, prompt)
        blocks_b = list(range(40, 59))
        scheduler.start_load(second, blocks_b)
        run_step()
        assert not scheduler.take_load_errors()
        n = cached // BLOCK
        same = all(torch.equal(layer[blocks_a[:n]], layer[blocks_b[:n]]) for layer in kv)
        print(
            f"{backend['kind']}: loaded {cached} of {len(prompt)} tokens from kvcore; bytes identical: {same}"
        )
        scheduler.finish(second)
        return 0 if same and cached in (256, 288) else 1  # two chunks, and the tail where it is kept
    finally:
        worker.close()
        scheduler.close()


if __name__ == "__main__":
    raise SystemExit(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else CPU_TIER))
