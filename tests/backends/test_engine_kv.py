"""EngineKV: every layout kind registers with its shape; a tensor that does not fit is refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from kvcore.errors import InvalidSpecError
from kvcore.layout import HeadOrder, KVLayout, LayoutKind
from kvcore_cpu.engine_kv import EngineKV

BLOCKS = 6


def layout(kind: LayoutKind, order: HeadOrder = HeadOrder.HND) -> KVLayout:
    heads = 1 if kind is LayoutKind.MLA else 2
    return KVLayout(
        kind, BLOCKS, block_tokens=4, num_kv_heads=heads, head_size=8, dtype_size=2, head_order=order
    )


LAYOUTS = [
    layout(LayoutKind.VLLM_CPU),
    layout(LayoutKind.FLASH_ATTN, HeadOrder.NHD),
    layout(LayoutKind.FLASH_ATTN, HeadOrder.HND),
    layout(LayoutKind.FLASH_INFER, HeadOrder.NHD),
    layout(LayoutKind.FLASH_INFER, HeadOrder.HND),
    layout(LayoutKind.MLA),
]
IDS = [f"{lay.kind.value}-{lay.head_order.value}" for lay in LAYOUTS]


def tensors(lay: KVLayout, layers: int = 3, *, shared: bool = False) -> list[torch.Tensor]:
    """Contiguous tensors in memory order (``physical_shape``)."""
    shape = lay.physical_shape
    if shared:
        return list(torch.randn((layers, *shape)).to(torch.bfloat16).unbind(0))
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(layers)]


def block_bytes(tensor: torch.Tensor, lay: KVLayout, block: int) -> bytes:
    """One block of one layer as a host block holds it: K then V for FlashAttention, else in order."""
    if lay.kind is LayoutKind.FLASH_ATTN:
        return tensor[0, block].numpy().tobytes() + tensor[1, block].numpy().tobytes()
    return tensor[block].contiguous().view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("kind", [LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER])
def test_the_engines_hnd_view_registers_like_its_memory(kind: LayoutKind) -> None:
    # vLLM's HND form: shape in NHD order [.., tokens, heads, head], strides heads-major
    lay = layout(kind, HeadOrder.HND)
    memory = tensors(lay)
    engine_view = [t.transpose(2, 3) for t in memory]
    assert tuple(engine_view[0].shape) == lay.shape
    assert engine_view[0].stride() == lay.strides
    by_view, by_memory = EngineKV.register(engine_view, lay), EngineKV.register(memory, lay)
    for a, b in zip(by_view.planes, by_memory.planes, strict=True):
        assert a.data_ptr() == b.data_ptr()
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", [LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER])
def test_nhd_memory_declared_hnd_is_refused(kind: LayoutKind) -> None:
    # a contiguous tensor of the engine shape is NHD memory: its head runs are not where HND says
    lay = layout(kind, HeadOrder.HND)
    layers = [torch.zeros(lay.shape, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(InvalidSpecError, match=r"layer 0: contiguity: got strides .*, expected .*HND"):
        EngineKV.register(layers, lay)


@pytest.mark.parametrize("lay", LAYOUTS, ids=IDS)
def test_each_kind_registers_with_block_major_byte_views(lay: KVLayout) -> None:
    layers = tensors(lay)
    kv = EngineKV.register(layers, lay)
    planes = 2 if lay.kind is LayoutKind.FLASH_ATTN else 1
    k_and_v = 1 if lay.kind is LayoutKind.MLA else 2
    layer_block = k_and_v * 4 * lay.num_kv_heads * 8 * 2
    assert kv.num_layers == 3
    assert kv.num_blocks == BLOCKS
    assert kv.device == torch.device("cpu")
    assert kv.plane_bytes == layer_block // planes
    assert kv.host_block_bytes == 3 * layer_block
    assert [len(p) for p in kv.layers] == [planes] * 3
    for tensor, views in zip(layers, kv.layers, strict=True):
        for block in (0, 3, BLOCKS - 1):
            got = b"".join(v[block].numpy().tobytes() for v in views)
            assert got == block_bytes(tensor.view(torch.int16), lay, block)


def test_views_write_through_to_the_engine() -> None:
    lay = layout(LayoutKind.VLLM_CPU)
    layers = tensors(lay)
    kv = EngineKV.register(layers, lay)
    kv.layers[1][0][2].fill_(0)
    assert not layers[1][2].view(torch.int16).any()
    assert layers[1][1].view(torch.int16).any()


@pytest.mark.parametrize("lay", LAYOUTS, ids=IDS)
def test_one_storage_gives_shared_rows(lay: KVLayout) -> None:
    # vLLM CPU style: every layer a view into one buffer -> plane q's block b is rows[plane_rows[q] + b]
    kv = EngineKV.register(tensors(lay, shared=True), lay)
    assert kv.shared is not None
    for q, plane in enumerate(kv.planes):
        start = kv.shared.plane_rows[q]
        assert torch.equal(kv.shared.rows[start : start + BLOCKS], plane)


def test_separate_tensors_have_no_shared_rows() -> None:
    lay = layout(LayoutKind.FLASH_INFER)
    assert EngineKV.register(tensors(lay), lay).shared is None


def test_one_storage_at_unaligned_offsets_has_no_shared_rows() -> None:
    # two layers 2 bytes apart from a block boundary: rows of one block cannot address both
    lay = layout(LayoutKind.MLA)
    size = BLOCKS * 4 * 8
    flat = torch.zeros(2 * size + 1, dtype=torch.bfloat16)
    layers = [flat[:size].view(BLOCKS, 4, 8), flat[size + 1 :].view(BLOCKS, 4, 8)]
    kv = EngineKV.register(layers, lay)
    assert kv.shared is None


def test_no_tensors_is_refused() -> None:
    with pytest.raises(InvalidSpecError, match="at least 1"):
        EngineKV.register([], layout(LayoutKind.MLA))


@pytest.mark.parametrize("lay", LAYOUTS, ids=IDS)
def test_wrong_shape_names_layer_and_field(lay: KVLayout) -> None:
    layers = tensors(lay)
    layers[2] = torch.zeros((*lay.physical_shape[:-1], 3), dtype=torch.bfloat16)
    expected = re.escape(str(lay.shape))
    with pytest.raises(InvalidSpecError, match=rf"layer 2: shape: got \(.*3\), expected {expected}"):
        EngineKV.register(layers, lay)


def test_layers_of_different_block_counts_are_refused() -> None:
    lay = layout(LayoutKind.VLLM_CPU)
    layers = tensors(lay)
    layers[1] = torch.zeros((BLOCKS + 1, 2, 4, 16), dtype=torch.bfloat16)
    with pytest.raises(
        InvalidSpecError, match=r"layer 1: shape: got \(7, 2, 4, 16\), expected \(6, 2, 4, 16\)"
    ):
        EngineKV.register(layers, lay)


def test_wrong_dtype_size_is_refused() -> None:
    lay = layout(LayoutKind.MLA)
    layers = tensors(lay)
    layers[0] = layers[0].float()
    with pytest.raises(InvalidSpecError, match=r"layer 0: dtype size: got 4 \(torch.float32\), expected 2"):
        EngineKV.register(layers, lay)


def test_mixed_dtypes_of_one_size_are_refused() -> None:
    lay = layout(LayoutKind.MLA)
    layers = tensors(lay)
    layers[1] = layers[1].half()
    with pytest.raises(InvalidSpecError, match=r"layer 1: dtype: got torch.float16, expected torch.bfloat16"):
        EngineKV.register(layers, lay)


def test_mixed_devices_are_refused() -> None:
    lay = layout(LayoutKind.MLA)
    layers = tensors(lay)
    layers[2] = torch.empty(lay.shape, dtype=torch.bfloat16, device="meta")
    with pytest.raises(InvalidSpecError, match=r"layer 2: device: got meta, expected cpu"):
        EngineKV.register(layers, lay)


def test_non_contiguous_tensor_is_refused() -> None:
    # right shape, transposed memory
    lay = layout(LayoutKind.VLLM_CPU)
    layers = tensors(lay)
    layers[1] = torch.zeros((16, 4, 2, BLOCKS), dtype=torch.bfloat16).permute(3, 2, 1, 0)
    with pytest.raises(InvalidSpecError, match=r"layer 1: contiguity: got strides"):
        EngineKV.register(layers, lay)


def test_layers_sharing_memory_are_refused() -> None:
    lay = layout(LayoutKind.MLA)
    layers = tensors(lay)
    layers[2] = layers[0]
    with pytest.raises(InvalidSpecError, match=r"layer 2: memory: .*layer 0"):
        EngineKV.register(layers, lay)
