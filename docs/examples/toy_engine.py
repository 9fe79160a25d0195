"""A toy engine that is not vLLM, using kvcore's engine-agnostic API with any installed backend.

Run it: ``python docs/examples/toy_engine.py`` (the embedded CPU tier), or give the ``backend`` section
of a config as JSON: ``python docs/examples/toy_engine.py '{"kind": "lmcache_mp", "url":
"tcp://127.0.0.1:5555"}'``. It serves a prompt (loading whatever kvcore already holds of it, computing
the rest, saving its KV), then serves the same prompt again in other blocks, where kvcore loads the
cached prefix instead of recomputing it, and checks the loaded bytes against the model's KV.

A tier that outlives the process (a disk directory, a Mooncake store, an LMCache server) still holds
the prompt's chunks on a second run: its first request then loads them too, and says so.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from array import array
from collections.abc import Mapping, Sequence

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


def model_kv(prompt: Sequence[int], blocks: int, shape: Sequence[int]) -> list[torch.Tensor]:
    """The toy's "model": per layer, the KV of the prompt's first ``blocks`` blocks. Like a real model's,
    it depends on the tokens alone, so KV that kvcore loads (even one saved by an earlier run) can be
    checked against computing it."""
    seed = zlib.crc32(array("I", prompt).tobytes())
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, *shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


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
    kind = backend["kind"]

    def run_step() -> None:
        plan = scheduler.take_plan()
        worker.execute(plan)
        scheduler.complete(worker.wait(plan.op_ids(), timeout=10.0))

    prompt = list(range(1000, 1300))  # 300 tokens
    expected = model_kv(prompt, -(-len(prompt) // BLOCK), layout.shape[1:])

    def serve(request: RequestId, blocks: list[int]) -> tuple[int, bool]:
        """One request: load what kvcore holds of the prompt, compute the rest, save the full chunks (and,
        with a local pool, the tail: the two whole blocks of the third chunk). Returns the tokens loaded
        and whether the loaded blocks hold exactly the model's KV."""
        loaded = 0
        if lookup(scheduler, request, prompt):
            loaded = scheduler.start_load(request, blocks)
            run_step()
            failed = scheduler.take_load_errors()
            if failed:
                raise RuntimeError(
                    f"{kind}: kvcore failed to load blocks {failed}: an engine recomputes them"
                )
        n = loaded // BLOCK
        same = all(torch.equal(layer[blocks[:n]], want[:n]) for layer, want in zip(kv, expected, strict=True))
        for layer, want in zip(kv, expected, strict=True):
            layer[blocks[n:]] = want[n:]
        scheduler.save(request, blocks, num_tokens=len(prompt))
        run_step()
        scheduler.finish(request)
        return loaded, same

    try:
        # 3. First request. On a fresh tier nothing is cached: its KV is computed and saved.
        earlier, earlier_same = serve(RequestId("first"), list(range(19)))
        if earlier:
            print(
                f"{kind}: found {earlier} of {len(prompt)} tokens saved by an earlier run; "
                f"loaded instead of computed; bytes identical: {earlier_same}"
            )

        # 4. Same prompt again, in other blocks: kvcore loads the cached prefix.
        cached, same = serve(RequestId("second"), list(range(40, 59)))
        if not cached:
            print(f"{kind}: loaded nothing from kvcore (0 of {len(prompt)} tokens): no bytes to compare")
            return 1
        print(f"{kind}: loaded {cached} of {len(prompt)} tokens from kvcore; bytes identical: {same}")
        ok = same and earlier_same and cached in (256, 288)  # two chunks, and the tail where it is kept
        return 0 if ok else 1
    finally:
        worker.close()
        scheduler.close()


if __name__ == "__main__":
    raise SystemExit(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else CPU_TIER))
