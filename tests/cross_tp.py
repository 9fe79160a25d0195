"""Engines at different tensor-parallel sizes sharing a remote tier, stepped by hand (``tests.hand_engine``):
one model of ``KV_HEADS`` KV heads, a writer at one TP size saves a prompt, a reader at another loads it,
and every head of every layer of every loaded block must be the writer's bytes of that head.

The engines are of one model (one ``model_id``: the namespace holds no parallel split), over random KV
of their own; only the loaded blocks can hold the writer's bytes. The tier is the config's (a disk tier,
a Mooncake store): the reader's pool is empty, so the chunks come from it.
"""

from __future__ import annotations

import attrs

from kvcore.config import KVCoreConfig
from kvcore.ids import RequestId
from kvcore.model.engine import EngineSpec
from tests.hand_engine import BLOCK, CHUNK_TOKENS, CHUNKS, PER_CHUNK, Engine, engine_spec, prompt, save

__all__ = ["KV_HEADS", "LAYERS", "cross_tp", "heads_of"]

KV_HEADS = 4
LAYERS = 2
_HEAD_BYTES = BLOCK * 2 * 16 * 2  # a head's K and V of one block of one layer: tokens x 2 x head x bf16


def spec(tp: int, model: str) -> EngineSpec:
    """The model at TP ``tp`` (heads split, or one replicated where ``tp`` exceeds them)."""
    return attrs.evolve(engine_spec(tp, kv_heads=KV_HEADS), model_id=model)


def heads_of(engine: Engine, blocks: range, *, loaded: bool) -> dict[tuple[int, int, int], bytes]:
    """``(block index in blocks, layer, KV head) -> bytes`` over every rank of ``engine``, by vLLM's head
    ownership. A head shared by several ranks is the lowest's (the one that writes it: the hand engine's
    ranks hold random KV of their own); in ``loaded`` blocks every rank sharing it must hold the same
    bytes of it."""
    tp = engine.spec.tp_size
    out: dict[tuple[int, int, int], bytes] = {}
    for rank in range(tp):
        local = engine.spec.layout.num_kv_heads
        first = rank * local if tp <= KV_HEADS else rank // (tp // KV_HEADS)
        for i, data in enumerate(engine.blocks(rank, blocks)):
            for layer in range(LAYERS):
                for h in range(local):
                    start = (layer * local + h) * _HEAD_BYTES
                    value = data[start : start + _HEAD_BYTES]
                    seen = out.setdefault((i, layer, first + h), value)
                    assert seen == value or not loaded, f"rank {rank} loaded another head {first + h}"
    return out


def cross_tp(config: KVCoreConfig, writer_tp: int, reader_tp: int, seed: int) -> tuple[Engine, Engine]:
    """A writer at ``writer_tp`` saves a prompt of ``CHUNKS`` chunks; a reader at ``reader_tp`` finds it
    all and loads it into its blocks 10...; both engines, still open (the caller closes them), after
    checking that each head of each layer the reader loaded is the writer's."""
    model = f"org/cross-tp-{seed}"
    tokens = prompt(seed)
    writer = Engine(config, spec(writer_tp, model), seed=seed)
    reader = None
    try:
        save(writer, "written", tokens)
        reader = Engine(config, spec(reader_tp, model), seed=seed + 1)
        served = CHUNKS * CHUNK_TOKENS
        assert reader.lookup("read", tokens) == served
        into = list(range(10, 10 + CHUNKS * PER_CHUNK))
        assert reader.sched.start_load(RequestId("read"), into) == served
        reader.step()
        assert reader.sched.take_load_errors() == {}
        want = heads_of(writer, range(CHUNKS * PER_CHUNK), loaded=False)
        got = heads_of(reader, range(10, 10 + CHUNKS * PER_CHUNK), loaded=True)
        assert len(want) == CHUNKS * PER_CHUNK * LAYERS * KV_HEADS
        assert got == want
        return writer, reader
    except BaseException:
        writer.close()
        if reader is not None:
            reader.close()
        raise
