"""Explicit descriptions of how an engine lays out the KV cache of one layer on one rank.

A layout is declared (from the engine's own description), then checked against the tensor; it is never
guessed from strides alone. Offsets are in bytes from the start of the layer's tensor: the caller adds the
tensor's base address.

Every layout splits a block into one or two *segments* (K then V, or a single KV / latent / state segment)
that sit at the same offset in every block, ``block_stride`` bytes apart (more than a block's bytes where
the engine pads its pages, or puts every layer's page of a block together: vLLM's cross-layer "BL*"
orders). Heads are sliced inside a segment: one run per segment when heads are the outer axis (HND, vLLM
CPU), one run per token when tokens are (NHD).

Each distinct byte order has a distinct ``name``: it is part of every key and of the P/D handshake, so
KV written in one order is never read as another.
"""

from __future__ import annotations

import enum
import re
from typing import Any, TypeVar

from attrs import Attribute, field, frozen
from attrs.validators import optional

from kvcore.checks import SIZE_LIMIT, int_in, is_int_in, positive_count
from kvcore.errors import InvalidSpecError

__all__ = ["ByteRange", "HeadOrder", "KVLayout", "LayoutKind"]

_non_negative = int_in(0)


class LayoutKind(enum.Enum):
    """Where K and V sit relative to the block axis."""

    VLLM_CPU = "vllm_cpu"  # [blocks, heads, block_tokens, 2*head]; a head's K, then its V: whole heads only
    PAGED = "paged"  # vLLM >= 0.32 on GPUs: [blocks, heads, block_tokens, 2*head], K|V per head and token
    FLASH_ATTN = "flash_attn"  # [2, blocks, ...]: a K plane and a V plane (vLLM < 0.32, SGLang-style)
    FLASH_INFER = "flash_infer"  # [blocks, 2, ...]: K then V inside each block (vLLM < 0.32)
    MLA = "mla"  # [blocks, block_tokens, latent]: one latent segment, no head axis
    STATE = "state"  # [blocks, 1, 1, state]: a recurrent (SSM) state per block, opaque bytes, no token axis


class HeadOrder(enum.Enum):
    """Order of the token and head axes inside one K or V segment."""

    NHD = "nhd"  # [block_tokens, heads, head]: a head range is one small run per token (vLLM's LBNHC)
    HND = "hnd"  # [heads, block_tokens, head]: a head range is one contiguous run (vLLM's LBHNC)


_E = TypeVar("_E", bound=enum.Enum)


def _member(cls: type[_E], name: str, value: object) -> _E:
    """``value`` as a member of ``cls``: a member itself, or its documented string value (``"hnd"``)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if member.value == value:
                return member
    accepted = ", ".join(repr(member.value) for member in cls)
    raise InvalidSpecError(f"KVLayout.{name}: got {value!r}, expected a {cls.__name__} or one of {accepted}")


def _layout_kind(value: LayoutKind | str) -> LayoutKind:
    return _member(LayoutKind, "kind", value)


def _head_order(value: HeadOrder | str) -> HeadOrder:
    return _member(HeadOrder, "head_order", value)


def _packing(instance: object, attribute: Attribute[Any], value: object) -> None:
    if not (isinstance(value, str) and _PACKING.fullmatch(value)):
        raise InvalidSpecError(
            f"KVLayout.packing: got {value!r}, expected '' or up to 32 of a-z, 0-9, '_', '-', '.'"
        )


_PACKING = re.compile(r"[a-z0-9_.-]{0,32}")


@frozen
class ByteRange:
    """``length`` bytes starting ``offset`` bytes into a layer's tensor."""

    offset: int = field(validator=_non_negative)
    length: int = field(validator=positive_count)

    @property
    def stop(self) -> int:
        """First byte after the range."""
        return self.offset + self.length


@frozen
class KVLayout:
    """The KV tensor of one layer on one rank.

    ``num_kv_heads`` counts the heads this rank holds (for MLA: 1, and ``head_size`` is the latent
    width). ``dtype_size`` is bytes per element. ``head_order`` only matters for paged, FlashAttention and
    FlashInfer (vLLM CPU is always heads-major; MLA has a single head, so both orders are the same bytes).

    A ``state`` layout is a recurrent model's state (vLLM's Mamba layers): a block holds the state after
    its last token, ``head_size`` elements of opaque bytes whatever ``block_tokens`` it covers, which
    kvcore moves whole (``packing`` then names what the bytes are: the state's kind, shapes and dtypes).

    ``packing`` names how the engine orders the bytes inside the unit kvcore moves whole, where that
    order is the engine's business (vLLM CPU: its attention ISA, ``"amx"`` or ``"vec"``, orders each
    head's K and V differently); kvcore never reads those bytes, but two packings must never share keys
    or exchange KV, so it is part of ``name``. ``page_bytes`` is the distance between two blocks of the
    layer where it is more than a block's bytes: the engine pads its pages (vLLM's ``page_size_padded``),
    or interleaves layers, block by block (vLLM's block-outermost orders BLHNC and BLNHC, where the bytes
    between two blocks of a layer are the other layers' pages of the first); ``None`` when blocks are
    dense. It is not part of ``name``: the bytes kvcore copies, and their order, are the same.

    ``kind`` and ``head_order`` take their enum or the enum's value (``"flash_infer"``, ``"nhd"``: what a
    configuration file or a peer's handshake carries); anything else is refused, never read as another
    kind. Every count is an ``int`` in ``[1, 2**62]`` and the whole tensor is at most ``2**62`` bytes;
    a violation raises ``InvalidSpecError`` naming the field and the value.
    """

    kind: LayoutKind = field(converter=_layout_kind)
    num_blocks: int = field(validator=positive_count)
    block_tokens: int = field(validator=positive_count)
    num_kv_heads: int = field(validator=positive_count)
    head_size: int = field(validator=positive_count)
    dtype_size: int = field(validator=positive_count)
    head_order: HeadOrder = field(default=HeadOrder.HND, converter=_head_order)
    packing: str = field(default="", validator=_packing)
    page_bytes: int | None = field(default=None, validator=optional(positive_count))

    def __attrs_post_init__(self) -> None:
        if self.page_bytes is not None:
            if self.kind is LayoutKind.FLASH_ATTN:
                raise InvalidSpecError("KVLayout.page_bytes: flash_attn has K and V planes, not pages")
            if self.page_bytes < self.block_bytes or self.page_bytes % self.dtype_size:
                raise InvalidSpecError(
                    f"KVLayout.page_bytes: got {self.page_bytes}, expected a multiple of dtype_size "
                    f"{self.dtype_size} of at least block_bytes {self.block_bytes}"
                )
        if self.nbytes > SIZE_LIMIT:
            raise InvalidSpecError(
                f"KVLayout: num_blocks {self.num_blocks} x block_bytes {self.block_bytes} = {self.nbytes} "
                "bytes, expected at most 2**62"
            )
        if self.kind in _ONE_HEAD and self.num_kv_heads != 1:
            raise InvalidSpecError(
                f"a{'n MLA' if self.kind is LayoutKind.MLA else ' state'} layout has one 'head' (its latent "
                f"or state): num_kv_heads must be 1, got {self.num_kv_heads}"
            )
        if self.kind is LayoutKind.VLLM_CPU and self.head_order is not HeadOrder.HND:
            raise InvalidSpecError("the vLLM CPU layout is heads-major: head_order must be HND, got NHD")

    # -- shapes, in elements ----------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's logical shape in elements, as the engine (vLLM) reports it."""
        n, t, h, s = self.num_blocks, self.block_tokens, self.num_kv_heads, self.head_size
        if self.kind in (LayoutKind.VLLM_CPU, LayoutKind.PAGED):
            return (n, h, t, 2 * s)
        if self.kind is LayoutKind.FLASH_ATTN:
            return (2, n, t, h, s)
        if self.kind is LayoutKind.FLASH_INFER:
            return (n, 2, t, h, s)
        if self.kind is LayoutKind.STATE:
            return (n, 1, 1, s)
        return (n, t, s)

    @property
    def physical_shape(self) -> tuple[int, ...]:
        """The shape in memory order: a contiguous tensor of this shape has exactly this layout (less any
        page padding).

        It differs from ``shape`` where the engine's shape keeps one axis order and permutes the strides:
        HND FlashAttention / FlashInfer (engine shape NHD) and NHD paged (engine shape HND).
        """
        shape = self.shape
        return tuple(shape[axis] for axis in self._memory_order)

    @property
    def _memory_order(self) -> tuple[int, ...]:
        """The axes of ``shape`` from outermost to innermost in memory."""
        if self.kind is LayoutKind.PAGED and self.head_order is HeadOrder.NHD:
            return (0, 2, 1, 3)
        if self.kind in _PLANE_KINDS and self.head_order is HeadOrder.HND:
            return (0, 1, 3, 2, 4)
        return tuple(range(len(self.shape)))

    @property
    def strides(self) -> tuple[int, ...]:
        """Element strides of ``shape`` (what ``torch.Tensor.stride()`` reports for the engine's tensor)."""
        physical = self.physical_shape
        dense = [1] * len(physical)
        for axis in range(len(physical) - 2, -1, -1):
            dense[axis] = dense[axis + 1] * physical[axis + 1]
        block_axis = 1 if self.kind is LayoutKind.FLASH_ATTN else 0
        dense[block_axis] = self.block_stride // self.dtype_size
        strides = [0] * len(physical)
        for position, axis in enumerate(self._memory_order):
            strides[axis] = dense[position]
        return tuple(strides)

    @property
    def name(self) -> str:
        """The byte order's name: equal for two layouts exactly when their blocks hold the same bytes in
        the same order (what keys and the P/D handshake carry)."""
        order = "" if self.kind in (LayoutKind.VLLM_CPU, *_ONE_HEAD) else f"/{self.head_order.value}"
        return self.kind.value + order + (f"/{self.packing}" if self.packing else "")

    # -- sizes and strides, in bytes ----------------------------------------------------------------------

    @property
    def segments_per_block(self) -> int:
        """2 (K and V) for FlashAttention / FlashInfer; 1 for vLLM CPU and paged (K and V inside), MLA and
        state."""
        return 2 if self.kind in _PLANE_KINDS else 1

    @property
    def segment_bytes(self) -> int:
        """Bytes of one segment of one block (a state's: ``head_size`` elements, whatever the block's
        tokens)."""
        heads = 2 * self.num_kv_heads if self.kind in _KV_INSIDE else self.num_kv_heads
        tokens = 1 if self.kind is LayoutKind.STATE else self.block_tokens
        return tokens * heads * self.head_size * self.dtype_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all of its segments (what a host block holds of it)."""
        return self.segments_per_block * self.segment_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor, padding included."""
        if self.kind is LayoutKind.FLASH_ATTN:
            return self.num_blocks * self.block_bytes
        return self.num_blocks * self.block_stride

    @property
    def extent(self) -> int:
        """Bytes from the layer's first byte to the end of its last block: ``nbytes`` less the last page's
        padding, which (cross-layer: the other layers' pages) is not the layer's memory."""
        if self.kind is LayoutKind.FLASH_ATTN:
            return self.nbytes
        return (self.num_blocks - 1) * self.block_stride + self.block_bytes

    @property
    def block_stride(self) -> int:
        """Bytes from a segment of block ``b`` to the same segment of block ``b + 1``."""
        if self.kind is LayoutKind.FLASH_ATTN:
            return self.segment_bytes
        return self.block_bytes if self.page_bytes is None else self.page_bytes

    @property
    def head_stride(self) -> int:
        """Bytes from head ``h`` to head ``h + 1`` inside a segment."""
        head_bytes = self.head_size * self.dtype_size * (2 if self.kind in _KV_INSIDE else 1)
        if self.kind is LayoutKind.STATE:
            return head_bytes
        if self.head_order is HeadOrder.NHD and self.kind is not LayoutKind.MLA:
            return head_bytes
        return self.block_tokens * head_bytes

    # -- byte ranges ---------------------------------------------------------------------------------------

    def segments(self, block: int) -> tuple[ByteRange, ...]:
        """The byte ranges of one block: K then V, or the single KV / latent segment."""
        self._check_block(block)
        first = block * self.block_stride
        if self.kind is LayoutKind.FLASH_ATTN:
            plane = self.num_blocks * self.segment_bytes
            return (ByteRange(first, self.segment_bytes), ByteRange(plane + first, self.segment_bytes))
        if self.kind is LayoutKind.FLASH_INFER:
            return (
                ByteRange(first, self.segment_bytes),
                ByteRange(first + self.segment_bytes, self.segment_bytes),
            )
        return (ByteRange(first, self.segment_bytes),)

    def head_runs(self, block: int, head_start: int, head_stop: int) -> tuple[ByteRange, ...]:
        """The byte runs holding local heads ``[head_start, head_stop)`` of one block, K runs then V runs.

        Heads-major layouts give one run per segment; NHD gives one run per token per segment unless the
        range covers every head (then the runs touch and are merged into the segment).
        """
        heads = self.num_kv_heads
        if not (is_int_in(head_start, 0, heads - 1) and is_int_in(head_stop, head_start + 1, heads)):
            raise InvalidSpecError(
                f"head range [{head_start}, {head_stop}) is not a non-empty part of "
                f"[0, {self.num_kv_heads}) ({self.kind.value} layout)"
            )
        segments = self.segments(block)
        if head_stop - head_start == self.num_kv_heads:
            return segments
        stride = self.head_stride
        run = (head_stop - head_start) * stride
        if self.head_order is HeadOrder.HND:
            return tuple(ByteRange(seg.offset + head_start * stride, run) for seg in segments)
        token_stride = self.num_kv_heads * stride
        return tuple(
            ByteRange(seg.offset + token * token_stride + head_start * stride, run)
            for seg in segments
            for token in range(self.block_tokens)
        )

    def _check_block(self, block: int) -> None:
        if not is_int_in(block, 0, self.num_blocks - 1):
            raise InvalidSpecError(f"block {block} is outside [0, {self.num_blocks})")


_PLANE_KINDS = frozenset({LayoutKind.FLASH_ATTN, LayoutKind.FLASH_INFER})
_ONE_HEAD = frozenset({LayoutKind.MLA, LayoutKind.STATE})
"""Kinds of one segment without a head axis: a latent per token (MLA), a state per block."""
_KV_INSIDE = frozenset({LayoutKind.VLLM_CPU, LayoutKind.PAGED})
"""Kinds whose one segment holds each head's K and V together (a head's unit is ``2 * head_size``)."""
