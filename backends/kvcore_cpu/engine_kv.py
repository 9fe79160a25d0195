"""The engine's KV tensors, checked against their declared layout and seen as rows of block bytes.

Copies move whole blocks, so the mover never needs dtypes or head axes: it needs, for every layer, the
*planes* that hold its blocks as ``[num_blocks, plane_bytes]`` byte views (FlashAttention: a K plane and
a V plane; every other layout: one plane). A host block is those planes' blocks, layer after layer, K
before V.

When every plane lives in one storage at offsets and block strides that are whole multiples of a plane
block (vLLM allocates all layers as views into one buffer), the planes are also exposed as a single row view
of that storage: the mover can then gather one block of every layer with one indexed copy instead of one per
layer. In vLLM's cross-layer orders a block of every layer is one run of that view, copied at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from attrs import frozen

from kvcore.errors import InvalidSpecError
from kvcore.model.layout import KVLayout, LayoutKind

__all__ = ["EngineKV", "SharedRows"]

_DEVICES = frozenset({"cpu", "cuda"})
"""Devices whose tensors hold memory that the mover's lanes copy (not ``meta``, which has none)."""

_SHAPE_NAMES = {
    LayoutKind.VLLM_CPU: "[blocks, heads, block_tokens, 2*head]",
    LayoutKind.PAGED: "[blocks, heads, block_tokens, 2*head]",
    LayoutKind.FLASH_ATTN: "[2, blocks, block_tokens, heads, head]",
    LayoutKind.FLASH_INFER: "[blocks, 2, block_tokens, heads, head]",
    LayoutKind.MLA: "[blocks, block_tokens, latent]",
    LayoutKind.STATE: "[blocks, 1, 1, state]",
}


@frozen(eq=False)
class SharedRows:
    """All planes as rows of one storage: plane ``q``'s block ``b`` is
    ``rows[plane_rows[q] + b * block_step]`` (``block_step`` is 1 where each layer's blocks follow each
    other, the number of layers where layers interleave block by block)."""

    rows: torch.Tensor
    plane_rows: tuple[int, ...]
    block_step: int = 1


@frozen(eq=False)
class EngineKV:
    """The registered KV tensors of every layer of one rank, sharing one layout and one device.

    Build it with ``EngineKV.register``. ``layers[i]`` holds layer ``i``'s planes, each a
    ``[num_blocks, plane_bytes]`` uint8 view of the engine's memory (writes go to the engine).
    """

    layout: KVLayout
    layers: tuple[tuple[torch.Tensor, ...], ...]
    shared: SharedRows | None

    @classmethod
    def register(
        cls, tensors: Sequence[torch.Tensor], layout: KVLayout, *, kv_dtype: str | None = None
    ) -> EngineKV:
        """Check every layer's tensor against ``layout`` and build the byte views.

        A tensor is either the engine's view (``layout.shape`` with ``layout.strides``: HND keeps the NHD
        axis order and permutes strides, as vLLM does) or a contiguous tensor of ``layout.physical_shape``
        (when the two shapes coincide, as for HND with as many tokens a block as heads, either form is
        taken). Tensors are dense (strided) CPU or CUDA tensors; with ``kv_dtype`` (an
        ``EngineSpec.kv_dtype``, torch's dtype name) every tensor has that dtype.

        Raises ``InvalidSpecError`` naming the layer, the field (type, device, shape, dtype size, dtype,
        contiguity, memory), what it got and what it expected.
        """
        if not isinstance(layout, KVLayout):
            raise InvalidSpecError(f"layout: got {type(layout).__name__}, expected a KVLayout")
        given: object = tensors  # checked as the anything a caller may pass
        if isinstance(given, str | bytes) or not isinstance(given, Sequence):
            raise InvalidSpecError(
                f"tensors: got {type(tensors).__name__}, expected a sequence of torch.Tensor, one per layer"
            )
        if not tensors:
            raise InvalidSpecError("tensors: got 0 layers, expected at least 1")
        first = tensors[0]
        for layer, tensor in enumerate(tensors):
            _check_layer(layer, tensor, first, layout, kv_dtype)
        _check_disjoint(tensors, layout)
        layers = tuple(_planes(layer, t, layout) for layer, t in enumerate(tensors))
        return cls(layout, layers, _shared_rows(first, [p for planes in layers for p in planes]))

    @property
    def device(self) -> torch.device:
        return self.layers[0][0].device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def planes(self) -> tuple[torch.Tensor, ...]:
        """Every plane in host-block order: layer after layer, K before V."""
        return tuple(p for planes in self.layers for p in planes)

    @property
    def plane_bytes(self) -> int:
        """Bytes of one block of one plane (the unit every copy is made of)."""
        return int(self.layers[0][0].shape[1])

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host block: one block of every plane of every layer."""
        return self.plane_bytes * sum(len(planes) for planes in self.layers)


def _fail(layer: int, field: str, got: object, expected: str) -> InvalidSpecError:
    return InvalidSpecError(f"layer {layer}: {field}: got {got}, expected {expected}")


def _check_layer(layer: int, tensor: object, first: object, layout: KVLayout, kv_dtype: str | None) -> None:
    if not isinstance(tensor, torch.Tensor) or not isinstance(first, torch.Tensor):
        raise _fail(layer, "type", type(tensor).__name__, "a torch.Tensor")
    if tensor.device.type not in _DEVICES:
        raise _fail(layer, "device", tensor.device, "cpu or cuda (a tensor with memory kvcore can copy)")
    if tensor.layout is not torch.strided:
        raise _fail(layer, "tensor layout", tensor.layout, "torch.strided (a dense tensor)")
    got = tuple(tensor.shape)
    if got not in (layout.shape, layout.physical_shape):
        raise _fail(layer, "shape", got, _shape_hint(layout))
    if tensor.element_size() != layout.dtype_size:
        raise _fail(
            layer, "dtype size", f"{tensor.element_size()} ({tensor.dtype})", f"{layout.dtype_size} bytes"
        )
    if kv_dtype is not None and str(tensor.dtype) != f"torch.{kv_dtype}":
        raise _fail(layer, "dtype", tensor.dtype, f"torch.{kv_dtype} (the engine's kv_dtype)")
    if tensor.dtype != first.dtype:
        raise _fail(layer, "dtype", tensor.dtype, f"{first.dtype} (layer 0's)")
    if tensor.device != first.device:
        raise _fail(layer, "device", tensor.device, f"{first.device} (layer 0's)")
    # Either form is taken when the shapes coincide (HND with as many tokens a block as heads).
    engine_form = got == layout.shape and _strides_match(tensor, layout.strides)
    dense = layout.page_bytes is None and got == layout.physical_shape and tensor.is_contiguous()
    if not engine_form and not dense:
        padding = "" if layout.page_bytes is None else f", pages of {layout.page_bytes} bytes"
        accepted = (
            [f"{layout.strides} ({layout.head_order.value.upper()}{padding})"] if got == layout.shape else []
        )
        if got == layout.physical_shape and layout.page_bytes is None:
            accepted.append("a contiguous tensor")
        raise _fail(layer, "contiguity", f"strides {tensor.stride()}", " or ".join(accepted))


def _shape_hint(layout: KVLayout) -> str:
    names = f"{_SHAPE_NAMES[layout.kind]} for {layout.kind.value}"
    if layout.shape == layout.physical_shape:
        return f"{layout.shape} ({names})"
    return f"{layout.shape} ({names}, {layout.head_order.value.upper()} strides) or {layout.physical_shape}"


def _strides_match(tensor: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Strides equal where they matter: an axis of size 1 is never stepped over."""
    return all(
        size == 1 or got == want
        for size, got, want in zip(tensor.shape, tensor.stride(), strides, strict=True)
    )


def _check_disjoint(tensors: Sequence[torch.Tensor], layout: KVLayout) -> None:
    """Two layers sharing bytes would overwrite each other's blocks: refuse them.

    Layers whose spans overlap are taken only where their blocks interleave without touching (cross-layer
    orders): every block of one sits in the gap between two blocks of the other, at the same distance.
    (FlashAttention's planes never can: a block's bytes are twice its stride.)"""
    stride, block, span = layout.block_stride, layout.block_bytes, layout.extent
    spans = sorted((t.data_ptr(), layer) for layer, t in enumerate(tensors))
    for i, (start, before) in enumerate(spans):
        for other, layer in spans[i + 1 :]:
            if other >= start + span:
                break
            gap = (other - start) % stride
            if not block <= gap <= stride - block:
                first, second = sorted((layer, before))
                raise _fail(second, "memory", "bytes shared", f"no overlap with layer {first}")


def _planes(layer: int, tensor: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, ...]:
    """The layer's blocks as ``[num_blocks, plane_bytes]`` byte rows over the tensor's own memory (its
    strides were checked against the layout, so the rows are where the layout says)."""
    try:
        data = tensor.view(torch.uint8)
    # torch refuses byte views of some tensors of a valid dtype size (a lazily conjugated complex view).
    except RuntimeError as exc:
        raise _fail(layer, "dtype", tensor.dtype, f"a tensor whose bytes can be viewed ({exc})") from None
    offset = data.storage_offset()
    if layout.kind is LayoutKind.FLASH_ATTN:
        rows, plane = (layout.num_blocks, layout.segment_bytes), layout.num_blocks * layout.segment_bytes
        return tuple(torch.as_strided(data, rows, (rows[1], 1), offset + kv * plane) for kv in (0, 1))
    rows = (layout.num_blocks, layout.block_bytes)
    return (torch.as_strided(data, rows, (layout.block_stride, 1), offset),)


def _shared_rows(first: torch.Tensor, planes: Sequence[torch.Tensor]) -> SharedRows | None:
    storage = first.untyped_storage()
    base = storage.data_ptr()
    row_bytes = int(planes[0].shape[1])
    stride = planes[0].stride(0)
    offsets = [p.data_ptr() - base for p in planes]
    same_storage = all(p.untyped_storage().data_ptr() == base for p in planes)
    if not same_storage or any(p.stride(0) != stride for p in planes):
        return None
    if stride % row_bytes or any(offset % row_bytes for offset in offsets):
        return None
    count = storage.nbytes() // row_bytes
    rows = torch.as_strided(planes[0], (count, row_bytes), (row_bytes, 1), 0)
    return SharedRows(rows, tuple(offset // row_bytes for offset in offsets), stride // row_bytes)
