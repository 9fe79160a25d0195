"""One value per KV head: a chunk written at one tensor-parallel size is read at any other, byte for byte.

The property: for random models (KV heads 1-16, head sizes, dtypes, every layout kind whose heads can be
cut apart, MLA's shared latent) and random writer and reader TP sizes, every head of every layer that a
reader rank fetches equals the same head of the same layer the writer saved. The writer's and the
reader's slots are built here from the engine's own tensors (numpy arrays in the layout's memory order,
sliced by heads as vLLM splits them), independently of ``HeadRuns``; the values cross through
``StoreRemote`` and the in-memory reference store, under the keys ``Keyspace`` renders at each TP size.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.errors import UsageError
from kvcore.execution.remote import StoreRemote
from kvcore.ids import ChunkKey
from kvcore.keying.hashing import HashAlgorithm
from kvcore.keying.keys import (
    HEAD_SEPARATOR,
    HeadKeyspaces,
    Keyspace,
    Namespace,
    Shard,
    head_keys,
    is_shard_writer,
    lookup_keys,
)
from kvcore.model.engine import EngineSpec
from kvcore.model.head_runs import HeadRuns, splits
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.ports import StoreItem
from kvcore.testing.memory import InMemoryChunkStore

CHUNK_HASH = bytes(range(32))
WAIT_S = 5.0
KINDS = [
    (LayoutKind.VLLM_CPU, HeadOrder.HND),
    (LayoutKind.PAGED, HeadOrder.HND),
    (LayoutKind.FLASH_ATTN, HeadOrder.HND),
    (LayoutKind.FLASH_INFER, HeadOrder.HND),
    (LayoutKind.MLA, HeadOrder.HND),
]


def namespace(heads: int, secret: bytes | None) -> Namespace:
    return Namespace(
        model_id="m",
        epoch="e",
        kv_dtype="bfloat16",
        num_layers=4,
        num_kv_heads=heads,
        head_size=8,
        layout="vllm_cpu",
        block_tokens=16,
        chunk_tokens=32,
        hash_algorithm=HashAlgorithm.SHA256,
        hash_seed_digest="00",
        secret=secret,
    )


def tp_sizes(heads: int) -> list[int]:
    """The TP sizes vLLM runs a model of ``heads`` KV heads at (up to 16): divisors, or multiples to
    replicate."""
    return [tp for tp in range(1, 17) if heads % tp == 0 or tp % heads == 0]


def rank_keys(heads: int, tp: int, secret: bytes | None = None) -> list[ChunkKey]:
    """Each rank's key of one chunk for a tier that keeps values per KV head."""
    ns = namespace(heads, secret)
    shards = [Shard.for_tp_rank(4, heads, tp, r) for r in range(tp)]
    return [HeadKeyspaces.for_shard(ns, shard).keys((CHUNK_HASH,))[0] for shard in shards]


@given(heads=st.integers(1, 16), secret=st.sampled_from([None, b"a deployment secret"]), data=st.data())
@settings(max_examples=200, deadline=None)
def test_every_tp_size_names_each_head_alike(heads: int, secret: bytes | None, data: st.DataObject) -> None:
    a, b = (data.draw(st.sampled_from(tp_sizes(heads))) for _ in range(2))
    by_head = [lookup_keys(rank_keys(heads, tp, secret), per_head=True) for tp in (a, b)]
    assert by_head[0] == by_head[1]
    assert len(by_head[0]) == heads
    assert all(head_keys(key) == (key,) for key in by_head[0])  # a head's key is one key
    if secret is not None:  # each head's key is a MAC of its own: one seen tells nothing of another's
        assert len({key.rsplit("/", 1)[1] for key in by_head[0]}) == heads


def test_a_ranks_key_is_its_heads_keys_joined() -> None:
    ns = namespace(8, b"a deployment secret")
    shard = Shard(0, 4, 2, 5)
    joined = HeadKeyspaces.for_shard(ns, shard).keys((CHUNK_HASH, bytes(32)))
    for chunk, key in zip((CHUNK_HASH, bytes(32)), joined, strict=True):
        alone = tuple(Keyspace(ns, Shard(0, 4, h, h + 1)).key(chunk) for h in (2, 3, 4))
        assert head_keys(key) == alone
        assert all(HEAD_SEPARATOR not in k for k in alone)
    assert lookup_keys([joined[0], joined[0]], per_head=False) == (joined[0],)
    assert lookup_keys([joined[0], joined[0]], per_head=True) == head_keys(joined[0])


# -- the bytes ------------------------------------------------------------------------------------------


class Model:
    """A model's KV of one chunk, every layer and head, in the engine's memory order, and each rank's
    host slot built from it as the CPU mover copies blocks (layer after layer, K before V)."""

    def __init__(self, kind: LayoutKind, heads: int, head_bytes: int, tokens: int, layers: int, seed: int):
        self.kind, self.heads, self.layers = kind, (1 if kind is LayoutKind.MLA else heads), layers
        self.head_bytes, self.tokens, self.blocks = head_bytes, tokens, 3
        rng = np.random.default_rng(seed)
        shapes = {  # physical shapes, every head, in bytes
            LayoutKind.VLLM_CPU: (self.blocks, self.heads, tokens, 2 * head_bytes),
            LayoutKind.PAGED: (self.blocks, self.heads, tokens, 2 * head_bytes),
            LayoutKind.FLASH_ATTN: (2, self.blocks, self.heads, tokens, head_bytes),
            LayoutKind.FLASH_INFER: (self.blocks, 2, self.heads, tokens, head_bytes),
            LayoutKind.MLA: (self.blocks, tokens, head_bytes),
        }
        self.kv = [rng.integers(0, 256, shapes[kind], dtype=np.uint8) for _ in range(layers)]

    def spec(self, tp: int, dtype_size: int) -> EngineSpec:
        mla = self.kind is LayoutKind.MLA
        local = 1 if mla else max(self.heads // tp, 1)
        layout = KVLayout(
            self.kind,
            num_blocks=self.blocks,
            block_tokens=self.tokens,
            num_kv_heads=local,
            head_size=self.head_bytes // dtype_size,
            dtype_size=dtype_size,
        )
        dtype = {1: "int8", 2: "bfloat16", 4: "float32"}[dtype_size]
        return EngineSpec("m", dtype, self.layers, total_kv_heads=self.heads, layout=layout, tp_size=tp)

    def block(self, layer: int, block: int, first: int, stop: int) -> bytes:
        kv: npt.NDArray[np.uint8] = self.kv[layer]
        if self.kind is LayoutKind.MLA:
            parts = [kv[block]]
        elif self.kind is LayoutKind.FLASH_ATTN:
            parts = [kv[0, block, first:stop], kv[1, block, first:stop]]
        elif self.kind is LayoutKind.FLASH_INFER:
            parts = [kv[block, :, first:stop]]
        else:
            parts = [kv[block, first:stop]]
        return b"".join(bytes(part.tobytes()) for part in parts)

    def slot(self, shard: Shard, blocks: int) -> bytes:
        first, stop = (0, 1) if self.kind is LayoutKind.MLA else (shard.head_start, shard.head_stop)
        return b"".join(
            self.block(layer, block, first, stop) for block in range(blocks) for layer in range(self.layers)
        )


@given(
    kind=st.sampled_from([k for k, _ in KINDS]),
    heads=st.integers(1, 16),
    dtype_size=st.sampled_from([1, 2, 4]),
    head_elems=st.integers(1, 4),
    tokens=st.integers(1, 3),
    layers=st.integers(1, 3),
    tail=st.booleans(),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_a_reader_at_any_tp_fetches_exactly_the_heads_a_writer_at_another_saved(
    kind: LayoutKind,
    heads: int,
    dtype_size: int,
    head_elems: int,
    tokens: int,
    layers: int,
    tail: bool,
    data: st.DataObject,
) -> None:
    mla = kind is LayoutKind.MLA
    model = Model(kind, heads, head_elems * dtype_size, tokens, layers, seed=data.draw(st.integers(0, 99)))
    writer_tp, reader_tp = (data.draw(st.sampled_from(tp_sizes(heads)), label=name) for name in "wr")
    blocks = 1 if tail else 2  # a slot of two blocks, or a tail of its first
    specs = {tp: model.spec(tp, dtype_size) for tp in (writer_tp, reader_tp)}
    slot_bytes = 2 * max(spec.host_block_bytes for spec in specs.values())
    host = bytearray(slot_bytes * (writer_tp + reader_tp))
    store = InMemoryChunkStore(host)
    ns = namespace(model.heads, b"secret")

    def shards(tp: int) -> list[Shard]:
        return [Shard.for_tp_rank(layers, model.heads, tp, r, mla=mla) for r in range(tp)]

    def item(tp: int, rank: int, region: int) -> StoreItem:
        key = HeadKeyspaces.for_shard(ns, shards(tp)[rank]).keys((CHUNK_HASH,))[0]
        return StoreItem(key, region * slot_bytes, blocks * specs[tp].host_block_bytes)

    writer = StoreRemote(store, HeadRuns.of(specs[writer_tp]))
    for rank, shard in enumerate(shards(writer_tp)):
        if not is_shard_writer(rank, writer_tp, model.heads, mla=mla):
            continue
        written = item(writer_tp, rank, rank)
        host[written.offset : written.offset + written.length] = model.slot(shard, blocks)
        job = writer.submit_publish("w", [written])
        assert [r.ok for r in writer.wait([job], WAIT_S)] == [True]
    reader = StoreRemote(store, HeadRuns.of(specs[reader_tp]))
    for rank, shard in enumerate(shards(reader_tp)):
        read = item(reader_tp, rank, writer_tp + rank)
        job = reader.submit_fetch("r", [read])
        assert [r.ok for r in reader.wait([job], WAIT_S)] == [True]
        assert bytes(host[read.offset : read.offset + read.length]) == model.slot(shard, blocks)


def test_a_chunk_fails_where_one_of_its_heads_is_missing_and_only_that_chunk() -> None:
    model = Model(LayoutKind.VLLM_CPU, 4, 8, 2, 2, seed=1)
    spec = model.spec(1, 2)
    heads = HeadRuns.of(spec)
    assert heads is not None
    assert heads.heads == 4
    size = 2 * spec.host_block_bytes
    host = bytearray(4 * size)
    store = InMemoryChunkStore(host)
    remote = StoreRemote(store, heads)
    ns = namespace(4, None)
    keys = list(HeadKeyspaces.for_shard(ns, Shard(0, 2, 0, 4)).keys([bytes([n]) * 32 for n in (1, 2)]))
    items = [StoreItem(keys[n], n * size, size) for n in (0, 1)]
    host[: 2 * size] = model.slot(Shard(0, 2, 0, 4), 2) * 2
    assert [r.ok for r in remote.wait([remote.submit_publish("s", items)], WAIT_S)] == [True]
    assert len(store) == 8  # four heads of two chunks
    store.remove([head_keys(keys[1])[2]])
    fetched = [StoreItem(k, (2 + n) * size, size) for n, k in enumerate(keys)]
    (result,) = remote.wait([remote.submit_fetch("s", fetched)], WAIT_S)
    assert result.failed == (1,)
    assert host[2 * size : 3 * size] == host[:size]
    with pytest.raises(UsageError, match="whole host blocks"):
        remote.submit_fetch("s", [StoreItem(keys[0], 0, size - 1)])


def test_a_layout_whose_heads_are_runs_per_token_keeps_a_value_per_rank() -> None:
    layout = KVLayout(LayoutKind.PAGED, 4, 16, 2, 8, 2, head_order=HeadOrder.NHD)
    assert not splits(layout)
    assert HeadRuns.of(EngineSpec("m", "bfloat16", 2, 2, layout)) is None
    one = KVLayout(LayoutKind.PAGED, 4, 16, 1, 8, 2, head_order=HeadOrder.NHD)
    assert splits(one)  # one head per rank: its value is the rank's
