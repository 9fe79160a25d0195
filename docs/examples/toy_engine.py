"""A toy engine that is not vLLM, using kvcore's engine-agnostic API with the embedded CPU backend.

Run it: ``python docs/examples/toy_engine.py``. It serves a prompt, saves its KV, forgets it, serves the
same prompt again and loads the KV back instead of recomputing it, then checks the bytes.
"""

from __future__ import annotations

import torch

from kvcore import CacheScheduler, EngineSpec, HeadOrder, KVLayout, LayoutKind, RequestId, load_config
from kvcore_cpu import open_worker, pool_slots

BLOCK = 16  # tokens per engine block
LAYERS = 4


def main() -> int:
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

    # 2. Build both sides: the scheduler decides, the worker (one per rank) copies.
    config = load_config({"backend": {"kind": "cpu", "size": "256MiB"}, "chunk_tokens": 64})
    scheduler = CacheScheduler(config, engine, pool_slots(config, engine))
    worker = open_worker(config, engine, kv)

    def run_step() -> None:
        plan = scheduler.take_plan()
        worker.execute(plan)
        scheduler.complete(worker.wait(plan.op_ids(), timeout=10.0))

    prompt = list(range(1000, 1300))  # 300 tokens
    blocks_a = list(range(19))
    try:
        # 3. First request: nothing cached. "Compute" its KV, then save its full chunks.
        first = RequestId("first")
        assert scheduler.lookup(first, tokens=prompt) == 0
        for layer in kv:
            layer[blocks_a] = torch.randn(len(blocks_a), *layout.shape[1:]).to(torch.bfloat16)
        scheduler.save(first, blocks_a, num_tokens=len(prompt))
        run_step()
        scheduler.finish(first)

        # 4. Same prompt again, in other blocks: kvcore loads the cached prefix.
        second = RequestId("second")
        cached = scheduler.lookup(second, tokens=prompt) or 0
        blocks_b = list(range(40, 59))
        scheduler.start_load(second, blocks_b)
        run_step()
        assert not scheduler.take_load_errors()
        n = cached // BLOCK
        same = all(torch.equal(layer[blocks_a[:n]], layer[blocks_b[:n]]) for layer in kv)
        print(f"loaded {cached} of {len(prompt)} tokens from kvcore; bytes identical: {same}")
        scheduler.finish(second)
        return 0 if same and cached == 256 else 1
    finally:
        worker.close()


if __name__ == "__main__":
    raise SystemExit(main())
