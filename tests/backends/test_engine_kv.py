"""EngineKV: every layout kind registers with its shape; a tensor that does not fit is refused by name."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from kvcore.errors import InvalidSpecError
from kvcore.model.head_runs import HeadRuns
from kvcore.model.layout import HeadOrder, KVLayout, LayoutKind
from kvcore.ports import BlockTransfer, Direction
from kvcore_cpu.engine_kv import EngineKV
from kvcore_cpu.host_memory import HostMemory
from kvcore_cpu.mover import TorchBlockMover

BLOCKS = 6


def layout(kind: LayoutKind, order: HeadOrder = HeadOrder.HND) -> KVLayout:
    heads = 1 if kind in (LayoutKind.MLA, LayoutKind.STATE) else 2
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
    layout(LayoutKind.STATE),
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
    k_and_v = 1 if lay.kind in (LayoutKind.MLA, LayoutKind.STATE) else 2
    tokens = 1 if lay.kind is LayoutKind.STATE else 4  # a state is one per block
    layer_block = k_and_v * tokens * lay.num_kv_heads * 8 * 2
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


# -- the documented forms when the two shapes coincide, and tensors that cannot be registered ------------


def square(kind: LayoutKind) -> KVLayout:
    """HND with as many tokens a block as heads: the engine shape and the memory shape are equal."""
    return KVLayout(kind, BLOCKS, block_tokens=2, num_kv_heads=2, head_size=4, dtype_size=2)


@pytest.mark.parametrize("kind", [LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER])
def test_a_contiguous_hnd_tensor_registers_when_tokens_equal_heads(kind: LayoutKind) -> None:
    # every element distinct: a plane that transposed the contiguous tensor would reorder its bytes
    lay = square(kind)
    assert lay.shape == lay.physical_shape
    count = BLOCKS * lay.block_bytes // 2
    memory = [
        torch.arange(i * count, (i + 1) * count, dtype=torch.int16).view(lay.physical_shape) for i in range(2)
    ]
    layers = [m.view(torch.bfloat16) for m in memory]
    kv = EngineKV.register(layers, lay)
    for tensor, planes in zip(memory, kv.layers, strict=True):
        for block in range(BLOCKS):
            assert b"".join(p[block].numpy().tobytes() for p in planes) == block_bytes(tensor, lay, block)
    # the engine's own view of the same memory (NHD shape, HND strides) maps the same bytes
    by_view = EngineKV.register([t.transpose(2, 3) for t in layers], lay)
    for a, b in zip(by_view.planes, kv.planes, strict=True):
        assert a.data_ptr() == b.data_ptr()
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", [LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER])
def test_a_tensor_in_neither_form_is_refused_when_the_shapes_coincide(kind: LayoutKind) -> None:
    lay = square(kind)
    shape = lay.physical_shape
    odd = torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=torch.bfloat16)[..., ::2]  # strided last axis
    with pytest.raises(InvalidSpecError, match=r"layer 0: contiguity: got strides .* or a contiguous tensor"):
        EngineKV.register([odd], lay)


def test_a_dtype_other_than_kv_dtype_is_refused() -> None:
    lay = layout(LayoutKind.MLA)
    layers = [t.view(torch.float16) for t in tensors(lay)]
    assert EngineKV.register(layers, lay, kv_dtype="float16").num_layers == 3
    with pytest.raises(
        InvalidSpecError,
        match=r"layer 0: dtype: got torch.float16, expected torch.bfloat16 \(the engine's kv_dtype\)",
    ):
        EngineKV.register(layers, lay, kv_dtype="bfloat16")


def test_meta_tensors_are_refused_before_their_memory_is_read() -> None:
    # meta tensors have data_ptr 0: today's disjointness check would call them overlapping layers
    lay = layout(LayoutKind.MLA)
    layers = [torch.empty(lay.shape, dtype=torch.bfloat16, device="meta") for _ in range(2)]
    with pytest.raises(InvalidSpecError, match=r"layer 0: device: got meta, expected cpu or cuda"):
        EngineKV.register(layers, lay)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (
            lambda t: [t[0], t[1].view(torch.int16).numpy()],
            r"layer 1: type: got ndarray, expected a torch.Tensor",
        ),
        (
            lambda t: [t[0].to_sparse()],
            r"layer 0: tensor layout: got torch.sparse_coo, expected torch.strided",
        ),
        (lambda t: t[0], r"tensors: got Tensor, expected a sequence of torch.Tensor"),
        (iter, r"tensors: got list_iterator, expected a sequence"),
    ],
    ids=["ndarray", "sparse", "one-stacked-tensor", "iterator"],
)
def test_what_is_not_a_list_of_dense_tensors_is_refused(
    layers: Callable[[list[torch.Tensor]], object], message: str
) -> None:
    lay = layout(LayoutKind.MLA)
    with pytest.raises(InvalidSpecError, match=message):
        EngineKV.register(layers(tensors(lay)), lay)  # type: ignore[arg-type]  # wrong on purpose


def test_a_conjugate_view_is_refused_by_dtype() -> None:
    # complex64 has 8-byte elements, but torch cannot view a lazily conjugated tensor as bytes
    lay = KVLayout(LayoutKind.MLA, BLOCKS, block_tokens=4, num_kv_heads=1, head_size=8, dtype_size=8)
    conj = torch.zeros(lay.shape, dtype=torch.complex64).conj()
    with pytest.raises(
        InvalidSpecError, match=r"layer 0: dtype: got torch.complex64, expected a tensor whose"
    ):
        EngineKV.register([conj], lay)


def test_a_layout_that_is_not_a_kvlayout_is_refused() -> None:
    lay = layout(LayoutKind.MLA)
    with pytest.raises(InvalidSpecError, match=r"layout: got dict, expected a KVLayout"):
        EngineKV.register(tensors(lay), {"kind": "mla"})  # type: ignore[arg-type]  # wrong on purpose


@pytest.mark.parametrize(
    ("lead", "shared"), [(1, True), (0, True), (3, False)], ids=["row", "none", "unaligned"]
)
def test_layers_at_an_offset_in_one_storage_copy_the_right_blocks(lead: int, shared: bool) -> None:
    # layers start `lead` elements (of 2-byte rows of 64 bytes = 32 elements, in rows for lead 1) into one
    # buffer: aligned offsets share rows, unaligned ones do not; either way every block lands where it should
    lay = layout(LayoutKind.MLA)
    size = BLOCKS * 4 * 8
    start = lead * 32 if shared else lead
    flat = torch.arange(start + 2 * size, dtype=torch.int16).view(torch.bfloat16)
    layers = [flat[start + i * size : start + (i + 1) * size].view(lay.shape) for i in range(2)]
    kv = EngineKV.register(layers, lay)
    assert (kv.shared is not None) == shared
    if kv.shared is not None:
        assert kv.shared.plane_rows == (lead, lead + BLOCKS)
    host = HostMemory.allocate(BLOCKS, kv.host_block_bytes, kv.device)
    mover = TorchBlockMover(kv, host)
    blocks = [5, 0, 3]
    (result,) = mover.wait([mover.submit(BlockTransfer(Direction.SAVE, blocks, [0, 1, 2]))], 10.0)
    mover.close()
    assert result.ok
    for h, e in enumerate(blocks):
        expected = b"".join(block_bytes(t, lay, e) for t in layers)
        assert host.blocks[h].numpy().tobytes() == expected


def interleaved(lay: KVLayout, layers: int, *, gap: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """vLLM's cross-layer order: a buffer of blocks, each holding every layer's block (``gap`` spare
    elements after each layer's), and one engine view per layer into it."""
    dense = KVLayout(lay.kind, lay.num_blocks, lay.block_tokens, lay.num_kv_heads, lay.head_size, 2)
    page = dense.block_bytes // 2 + gap
    flat = torch.arange(lay.num_blocks * layers * page, dtype=torch.int16).view(torch.bfloat16)
    stride = tuple(layers * page if axis == 0 else s for axis, s in enumerate(dense.strides))
    views = [torch.as_strided(flat, dense.shape, stride, layer * page) for layer in range(layers)]
    return flat, views


def cross_layer(kind: LayoutKind, layers: int, gap: int = 0) -> KVLayout:
    dense = layout(kind)
    return KVLayout(
        kind, BLOCKS, 4, dense.num_kv_heads, 8, 2, page_bytes=layers * (dense.block_bytes + 2 * gap)
    )


@pytest.mark.parametrize("kind", [LayoutKind.VLLM_CPU, LayoutKind.PAGED, LayoutKind.MLA])
def test_interleaved_layers_register_with_a_block_of_every_layer_as_one_run(kind: LayoutKind) -> None:
    # cross-layer (BL*): layer l's block b is row b * layers + l of one row view; a saved block holds
    # each layer's block in turn, and loads back into another block of every layer, nothing else written
    lay = cross_layer(kind, 3)
    flat, views = interleaved(lay, 3)
    kv = EngineKV.register(views, lay)
    assert kv.shared is not None
    assert (kv.shared.plane_rows, kv.shared.block_step) == ((0, 1, 2), 3)
    before = flat.clone()
    host = HostMemory.allocate(4, kv.host_block_bytes, kv.device)
    mover = TorchBlockMover(kv, host)
    try:
        (saved,) = mover.wait([mover.submit(BlockTransfer(Direction.SAVE, [4, 5, 1], [0, 1, 2]))], 10.0)
        (loaded,) = mover.wait([mover.submit(BlockTransfer(Direction.LOAD, [0, 2], [0, 1]))], 10.0)
    finally:
        mover.close()
    assert saved.ok
    assert loaded.ok
    blocks = before.view(BLOCKS, -1)  # a block of every layer, layer after layer: a host block's order
    for h, e in enumerate([4, 5, 1]):
        assert host.blocks[h].numpy().tobytes() == blocks[e].view(torch.int16).numpy().tobytes()
    after = flat.view(BLOCKS, -1)
    assert torch.equal(after[0], blocks[4])
    assert torch.equal(after[2], blocks[5])
    assert torch.equal(after[[1, 3, 4, 5]], blocks[[1, 3, 4, 5]])


def test_interleaved_layers_with_spare_bytes_copy_every_block_without_them() -> None:
    # each layer's page padded by 3 elements: rows cannot address every layer at once (no shared rows);
    # copies still move exactly each layer's block and never write the spare bytes
    lay = cross_layer(LayoutKind.PAGED, 2, gap=3)
    flat, views = interleaved(lay, 2, gap=3)
    kv = EngineKV.register(views, lay)
    assert kv.shared is None
    spare = flat.view(BLOCKS, 2, -1)[:, :, -3:].clone()
    host = HostMemory.allocate(2, kv.host_block_bytes, kv.device)
    mover = TorchBlockMover(kv, host)
    try:
        (saved,) = mover.wait([mover.submit(BlockTransfer(Direction.SAVE, [3], [0]))], 10.0)
        host.blocks[1].fill_(7)
        (loaded,) = mover.wait([mover.submit(BlockTransfer(Direction.LOAD, [5], [1]))], 10.0)
    finally:
        mover.close()
    assert saved.ok
    assert loaded.ok
    pages = flat.view(BLOCKS, 2, -1)
    expected = b"".join(pages[3, layer, :-3].view(torch.int16).numpy().tobytes() for layer in range(2))
    assert host.blocks[0].numpy().tobytes() == expected
    assert (pages[5, :, :-3].view(torch.uint8) == 7).all()
    assert torch.equal(pages[:, :, -3:], spare)


@pytest.mark.parametrize("shift", [0, 1, 64, 127], ids=["same", "one-element", "half-block", "last"])
def test_interleaved_layers_that_share_bytes_are_refused(shift: int) -> None:
    # layer 1 placed `shift` elements after layer 0 in a buffer whose blocks are two pages apart: any
    # shift but a whole page puts some byte in both layers
    lay = cross_layer(LayoutKind.PAGED, 2)
    flat, views = interleaved(lay, 2)
    page = lay.block_bytes // 2
    assert page == 128
    assert shift < page
    moved = torch.as_strided(flat, views[1].shape, views[1].stride(), shift)
    with pytest.raises(InvalidSpecError, match=r"layer 1: memory: got bytes shared, expected no overlap"):
        EngineKV.register([views[0], moved], lay)


@pytest.mark.parametrize(
    ("kind", "gap"), [(LayoutKind.VLLM_CPU, 0), (LayoutKind.PAGED, 0), (LayoutKind.PAGED, 3)]
)
def test_a_head_mover_over_interleaved_padded_layers_moves_exactly_a_heads_runs(
    kind: LayoutKind, gap: int
) -> None:
    # head blocks (a KV head's runs of a host block) over vLLM's cross-layer order, pages padded or not:
    # a head block is that head's bytes of the whole block, and a load writes that head alone (no other
    # head, no spare byte)
    lay = cross_layer(kind, 3, gap=gap)
    flat, views = interleaved(lay, 3, gap=gap)
    kv = EngineKV.register(views, lay)
    runs = HeadRuns.of_layout(lay, 3)
    assert runs is not None
    whole = HostMemory.allocate(BLOCKS, kv.host_block_bytes, kv.device)
    heads = HostMemory.allocate(4, runs.head_bytes, kv.device)
    reference, mover = TorchBlockMover(kv, whole), TorchBlockMover(kv, heads, per_head=True)

    def run(on: TorchBlockMover, transfer: BlockTransfer) -> None:
        (result,) = on.wait([on.submit(transfer)], 10.0)
        assert result.ok

    def head_of(data: bytes, head: int) -> bytes:
        return b"".join(data[start : start + length] for start, length in runs.runs[head])

    try:
        run(reference, BlockTransfer(Direction.SAVE, range(BLOCKS), range(BLOCKS)))
        before = [whole.blocks[b].numpy().tobytes() for b in range(BLOCKS)]
        spare = flat.clone()
        for head in range(2):
            run(mover, BlockTransfer(Direction.SAVE, [4, 1], [2 * head, 2 * head + 1], head))
            assert heads.blocks[2 * head].numpy().tobytes() == head_of(before[4], head)
            assert heads.blocks[2 * head + 1].numpy().tobytes() == head_of(before[1], head)
        run(mover, BlockTransfer(Direction.LOAD, [0], [2], 1))  # head 1 of block 4 into block 0
        run(reference, BlockTransfer(Direction.SAVE, range(BLOCKS), range(BLOCKS)))
        after = [whole.blocks[b].numpy().tobytes() for b in range(BLOCKS)]
    finally:
        mover.close()
        reference.close()
    assert head_of(after[0], 1) == head_of(before[4], 1)
    assert head_of(after[0], 0) == head_of(before[0], 0)
    assert after[1:] == before[1:]
    changed = (flat.view(torch.int16) != spare.view(torch.int16)).nonzero().flatten().tolist()
    assert len(changed) <= runs.head_bytes // 2  # only head 1's bytes of block 0 (int16 elements)
